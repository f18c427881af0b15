package main

import (
	"io"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strings"
)

// Connection strings carry passwords. The CLI keeps them out of
// its output twice over: every connection string it prints goes through
// redactConn first, and everything it writes passes a redactor that blanks
// each secret found in the command line and in the credential environment
// variables, whichever library wrote the message.

const redacted = "xxxxx"

// secretEnv are the environment variables whose values are credentials the
// CLI or its client libraries read.
var secretEnv = []string{"PGPASSWORD", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "REDIS_PASSWORD", "ETCDCTL_PASSWORD", "NATS_PASSWORD"}

// keywordPassword finds password=VALUE in a PostgreSQL keyword/value DSN, the
// value bare or single-quoted, both with backslash escapes (a\ b is "a b").
var keywordPassword = regexp.MustCompile(`(?i)(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|(?:[^\s\\]|\\.)*\\?)`)

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
	if _, pw, ok := urlUserinfo(s); ok {
		// The password as written up to the last @, which is what the user
		// meant even where a URL parser stops earlier (at an unescaped / ? or
		// #, and then takes a piece of it for the password), and unescaped.
		add(pw)
		if dec, err := url.PathUnescape(pw); err == nil {
			add(dec)
			add(url.QueryEscape(dec))
			add(url.PathEscape(dec))
		}
	}
	for _, m := range keywordPassword.FindAllStringSubmatch(s, -1) {
		v := m[2]
		add(v)
		if len(v) >= 2 && v[0] == '\'' && v[len(v)-1] == '\'' {
			v = v[1 : len(v)-1]
			add(v)
		}
		add(unescapeKeyword(v)) // as the driver reads it
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

// unescapeKeyword removes the backslash escapes of a keyword DSN value.
func unescapeKeyword(v string) string {
	var b strings.Builder
	for i := 0; i < len(v); i++ {
		if v[i] == '\\' && i+1 < len(v) {
			i++
		}
		b.WriteByte(v[i])
	}
	return b.String()
}

// urlUserinfo splits a URL (scheme://user:password@host...) at its user
// information as written: the password runs to the last @ of the URL.
func urlUserinfo(s string) (head, password string, ok bool) {
	i := strings.Index(s, "://")
	if i < 0 {
		return "", "", false
	}
	rest := s[i+3:]
	at := strings.LastIndex(rest, "@")
	if at < 0 {
		return "", "", false
	}
	user, password, ok := strings.Cut(rest[:at], ":")
	return s[:i+3] + user, password, ok
}

// checkURLUserinfo refuses, as a usage error, a URL whose user name or
// password holds an unescaped @, /, ? or #: a URL parser would end the user
// information or the host there, connect to a host made of a piece of the
// password and print it.
func checkURLUserinfo(flagName, s string) error {
	i := strings.Index(s, "://")
	if i < 0 {
		return nil
	}
	rest := s[i+3:]
	at := strings.LastIndex(rest, "@")
	if at < 0 {
		return nil
	}
	if end := strings.IndexAny(rest, "/?#"); (end >= 0 && end < at) || strings.Contains(rest[:at], "@") {
		return usagef("%s %s: the user name or password holds an unescaped @, /, ? or #: percent-encode them (%%40, %%2F, %%3F, %%23)", flagName, redactConn(s))
	}
	return nil
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
	if strings.Contains(s, "://") {
		if head, _, ok := urlUserinfo(s); ok {
			rest := s[strings.Index(s, "://")+3:]
			return head + ":" + redacted + rest[strings.LastIndex(rest, "@"):]
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
	if flags, err := childBackendFlags(); err == nil {
		args = append(flags, args...) // a bench child's connection flags
	}
	for i, a := range args {
		r.secrets = append(r.secrets, secretsIn(a)...)
		if strings.HasPrefix(a, "-") {
			if _, v, ok := strings.Cut(a, "="); ok {
				r.secrets = append(r.secrets, secretsIn(v)...)
			}
		}
		// A NATS URL may carry a token, user information without a colon.
		if f, v, ok := strings.Cut(a, "="); ok && strings.TrimLeft(f, "-") == "nats-url" {
			r.secrets = append(r.secrets, natsSecrets(v)...)
		} else if strings.TrimLeft(a, "-") == "nats-url" && strings.HasPrefix(a, "-") && i+1 < len(args) {
			r.secrets = append(r.secrets, natsSecrets(args[i+1])...)
		}
	}
	for _, env := range []string{"AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"} { // endpoints fence reads
		r.secrets = append(r.secrets, secretsIn(os.Getenv(env))...)
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
