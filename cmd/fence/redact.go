package main

import (
	"io"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strings"
)

// Connection strings carry passwords (HAZARDS 10). The CLI keeps them out of
// its output twice over: every connection string it prints goes through
// redactConn first, and everything it writes passes a redactor that blanks
// each secret found in the command line and in the credential environment
// variables, whichever library wrote the message.

const redacted = "xxxxx"

// secretEnv are the environment variables whose values are credentials the
// CLI or its client libraries read.
var secretEnv = []string{"PGPASSWORD", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "REDIS_PASSWORD", "ETCDCTL_PASSWORD"}

// keywordPassword finds password=VALUE in a PostgreSQL keyword/value DSN, the
// value bare or single-quoted (with backslash escapes).
var keywordPassword = regexp.MustCompile(`(?i)(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s]*)`)

// secretsIn returns the passwords s carries, as a URL's user information
// (PostgreSQL, Redis, anything with a scheme), as password= in a keyword DSN,
// as user:password@ in a go-sql-driver/mysql DSN or before a host without a
// scheme; each also in its
// escaped and unquoted forms, as a library may print either.
func secretsIn(s string) []string {
	var out []string
	add := func(v string) {
		if v != "" && v != redacted {
			out = append(out, v)
		}
	}
	if u, err := url.Parse(s); err == nil && u.User != nil {
		if pw, ok := u.User.Password(); ok {
			add(pw)
			add(url.QueryEscape(pw))
			add(url.PathEscape(pw))
		}
	}
	if i := strings.Index(s, "://"); i >= 0 {
		// A URL that does not parse still shows its user information.
		rest := s[i+3:]
		if at := strings.LastIndex(rest, "@"); at >= 0 {
			if _, pw, ok := strings.Cut(rest[:at], ":"); ok {
				add(pw)
			}
		}
	}
	for _, m := range keywordPassword.FindAllStringSubmatch(s, -1) {
		v := m[2]
		add(v)
		if len(v) >= 2 && v[0] == '\'' && v[len(v)-1] == '\'' {
			add(strings.ReplaceAll(v[1:len(v)-1], `\'`, `'`))
		}
	}
	if _, pw, ok := mysqlUserinfo(s); ok {
		add(pw)
	} else if at := strings.LastIndex(s, "@"); at >= 0 && !strings.Contains(s, "://") && !strings.ContainsAny(s, " \t") {
		// user:password@host without a scheme, as an endpoint may be given.
		if _, pw, ok := strings.Cut(s[:at], ":"); ok {
			add(pw)
		}
	}
	return out
}

// mysqlUserinfo splits a go-sql-driver/mysql DSN
// (user:password@protocol(address)/dbname?params) at its user information: it
// returns the text before the password and the password, as the driver reads
// them (the last @ before the last /).
func mysqlUserinfo(dsn string) (user, password string, ok bool) {
	if strings.Contains(dsn, "://") {
		return "", "", false
	}
	slash := strings.LastIndex(dsn, "/")
	if slash < 0 {
		return "", "", false
	}
	at := strings.LastIndex(dsn[:slash], "@")
	if at < 0 {
		return "", "", false
	}
	user, password, ok = strings.Cut(dsn[:at], ":")
	return user, password, ok && password != ""
}

// redactConn returns the connection string s with its password replaced by
// xxxxx, for display: a URL, a keyword DSN or a MySQL DSN.
func redactConn(s string) string {
	if u, err := url.Parse(s); err == nil && strings.Contains(s, "://") {
		if _, ok := u.User.Password(); ok {
			return u.Redacted()
		}
		return s
	}
	if _, _, ok := mysqlUserinfo(s); ok {
		at := strings.LastIndex(s[:strings.LastIndex(s, "/")], "@")
		user, _, _ := strings.Cut(s[:at], ":")
		return user + ":" + redacted + s[at:]
	}
	s = keywordPassword.ReplaceAllString(s, "${1}"+redacted)
	for _, pw := range secretsIn(s) { // a URL that does not parse
		s = strings.ReplaceAll(s, pw, redacted)
	}
	return s
}

// redactor blanks known secrets in everything written through its writers.
type redactor struct {
	secrets []string // longest first, so a secret that contains another is blanked whole
}

// newRedactor returns a redactor for the secrets in args (each argument whole
// and, for -flag=value, its value) and in the credential environment variables.
func newRedactor(args []string) *redactor {
	r := &redactor{}
	for _, a := range args {
		r.secrets = append(r.secrets, secretsIn(a)...)
		if strings.HasPrefix(a, "-") {
			if _, v, ok := strings.Cut(a, "="); ok {
				r.secrets = append(r.secrets, secretsIn(v)...)
			}
		}
	}
	for _, env := range secretEnv {
		if v := os.Getenv(env); v != "" {
			r.secrets = append(r.secrets, v)
		}
	}
	slices.SortFunc(r.secrets, func(a, b string) int { return len(b) - len(a) })
	return r
}

// redact returns s with every known secret replaced by xxxxx.
func (r *redactor) redact(s string) string {
	for _, sec := range r.secrets {
		s = strings.ReplaceAll(s, sec, redacted)
	}
	return s
}

// writer returns w behind the redactor. Each Write is redacted whole: the CLI
// and its libraries write a message in one call, so a secret is never split
// between two writes.
func (r *redactor) writer(w io.Writer) io.Writer { return redactWriter{r, w} }

type redactWriter struct {
	r *redactor
	w io.Writer
}

func (rw redactWriter) Write(p []byte) (int, error) {
	if _, err := io.WriteString(rw.w, rw.r.redact(string(p))); err != nil {
		return 0, err
	}
	return len(p), nil
}
