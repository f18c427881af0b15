// Command vulnfilter reads govulncheck's JSON output (-format json) on stdin
// and fails when the code calls a vulnerable function of a required module.
// Vulnerabilities of the Go standard library are reported but do not fail: they
// are fixed by the Go release a machine runs, not by this module.
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
)

type message struct {
	Finding *struct {
		OSV          string `json:"osv"`
		FixedVersion string `json:"fixed_version"`
		Trace        []struct {
			Module   string `json:"module"`
			Version  string `json:"version"`
			Function string `json:"function"`
		} `json:"trace"`
	} `json:"finding"`
}

func main() {
	dec := json.NewDecoder(os.Stdin)
	called := map[string]string{} // osv -> "module@version (fixed in ...)"
	for {
		var m message
		err := dec.Decode(&m)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "vulnfilter: reading govulncheck output:", err)
			os.Exit(2)
		}
		f := m.Finding
		if f == nil || len(f.Trace) == 0 || f.Trace[0].Function == "" {
			continue // not called by this module's code
		}
		t := f.Trace[0]
		called[f.OSV] = fmt.Sprintf("%s@%s (fixed in %s)", t.Module, t.Version, f.FixedVersion)
	}
	ids := make([]string, 0, len(called))
	for id := range called {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	failed := 0
	for _, id := range ids {
		if len(called[id]) >= 7 && called[id][:7] == "stdlib@" {
			fmt.Printf("vulnfilter: warning: %s in the Go standard library %s: upgrade Go\n", id, called[id][7:])
			continue
		}
		fmt.Printf("vulnfilter: FAIL: %s in %s is called\n", id, called[id])
		failed++
	}
	fmt.Printf("vulnfilter: %d called vulnerabilities, %d in required modules\n", len(ids), failed)
	if failed > 0 {
		os.Exit(1)
	}
}
