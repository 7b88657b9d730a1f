package peers

import (
	"encoding/csv"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
)

// Header is the CSV header of results (one row per phase of a run), with
// the ratio's column named for the peer the ratios are taken to
// ("ratio_to_idem").
func Header(base string) []string {
	return []string{"date", "round", "peer", "concurrency", "phase", "requests", "errors",
		"seconds", "req_per_s", "p50_us", "p99_us", "p999_us", "max_us",
		"client_cpu_s", "server_cpu_s", "cpu_us_per_req", "ratio_to_" + base, "first_error"}
}

func f64(v float64, prec int) string { return strconv.FormatFloat(v, 'f', prec, 64) }

// Record is r as a CSV record (in Header's order).
func (r *Result) Record() []string {
	ratio := ""
	if r.Ratio > 0 {
		ratio = f64(r.Ratio, 4)
	}
	return []string{r.Date, strconv.Itoa(r.Round), r.Peer, strconv.Itoa(r.Concurrency), r.Phase,
		strconv.FormatUint(r.Requests, 10), strconv.FormatUint(r.Errors, 10),
		f64(r.Seconds, 3), f64(r.PerSec, 1), f64(r.P50us, 1), f64(r.P99us, 1), f64(r.P999us, 1), f64(r.MaxUs, 1),
		f64(r.ClientCPU, 3), f64(r.ServerCPU, 3), f64(r.CPUusPerReq, 2), ratio, r.FirstError}
}

// WriteCSV writes rows, with the header if header is true; their Ratio is
// to the peer base (see SetRatios).
func WriteCSV(w io.Writer, rows []Result, header bool, base string) error {
	cw := csv.NewWriter(w)
	if header {
		if err := cw.Write(Header(base)); err != nil {
			return err
		}
	}
	for i := range rows {
		if err := cw.Write(rows[i].Record()); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

// ReadCSV reads rows written by WriteCSV (columns found by their header
// name, so that columns may be added later; the ratio is read from the
// column whose name starts with "ratio_to_").
func ReadCSV(r io.Reader) ([]Result, error) {
	cr := csv.NewReader(r)
	cr.FieldsPerRecord = -1
	recs, err := cr.ReadAll()
	if err != nil {
		return nil, err
	}
	if len(recs) == 0 {
		return nil, fmt.Errorf("empty CSV (no header)")
	}
	col := map[string]int{}
	for i, h := range recs[0] {
		if strings.HasPrefix(h, "ratio_to_") {
			h = "ratio"
		}
		col[h] = i
	}
	for _, h := range Header("") {
		if _, ok := col[h]; !ok && h != "ratio_to_" && h != "first_error" {
			return nil, fmt.Errorf("CSV header has no column %q", h)
		}
	}
	var out []Result
	for n, rec := range recs[1:] {
		line := n + 2
		get := func(h string) string {
			if i, ok := col[h]; ok && i < len(rec) {
				return rec[i]
			}
			return ""
		}
		var perr error
		num := func(h string) float64 {
			s := get(h)
			if s == "" {
				return 0
			}
			v, err := strconv.ParseFloat(s, 64)
			if err != nil && perr == nil {
				perr = fmt.Errorf("line %d, column %s: %q is not a number", line, h, s)
			}
			return v
		}
		r := Result{Date: get("date"), Round: int(num("round")), Peer: get("peer"),
			Concurrency: int(num("concurrency")), Phase: get("phase"),
			Requests: uint64(num("requests")), Errors: uint64(num("errors")), Seconds: num("seconds"),
			PerSec: num("req_per_s"), P50us: num("p50_us"), P99us: num("p99_us"), P999us: num("p999_us"),
			MaxUs: num("max_us"), ClientCPU: num("client_cpu_s"), ServerCPU: num("server_cpu_s"),
			CPUusPerReq: num("cpu_us_per_req"), Ratio: num("ratio"), FirstError: get("first_error")}
		if perr != nil {
			return nil, perr
		}
		out = append(out, r)
	}
	return out, nil
}

// SetRatios sets every row's Ratio to its throughput over the peer base's
// in the same round, concurrency and phase (0 where base has no such row).
func SetRatios(rows []Result, base string) {
	type key struct {
		round, conc int
		phase       string
	}
	ref := map[key]float64{}
	for _, r := range rows {
		if r.Peer == base {
			ref[key{r.Round, r.Concurrency, r.Phase}] = r.PerSec
		}
	}
	for i := range rows {
		r := &rows[i]
		r.Ratio = 0
		if b := ref[key{r.Round, r.Concurrency, r.Phase}]; b > 0 {
			r.Ratio = r.PerSec / b
		}
	}
}

// Median is the medians over rounds of one peer, concurrency and phase.
type Median struct {
	Peer        string
	Concurrency int
	Phase       string
	Rounds      int
	Errors      uint64 // summed over the rounds
	PerSec      float64
	MinPerSec   float64
	MaxPerSec   float64
	P50us       float64
	P99us       float64
	P999us      float64
	CPUusPerReq float64
	Ratio       float64 // median of the per-round ratios to the base peer
	// BaseOver is the median of the per-round ratios the other way: the
	// base peer's requests/s over this one's (with an even number of
	// rounds it is not exactly 1/Ratio).
	BaseOver float64
}

// Medians groups rows (with Ratio set) by peer, concurrency and phase, in
// the order of Names, then concurrency, then phase (fresh first).
func Medians(rows []Result) []Median {
	type key struct {
		peer  string
		conc  int
		phase string
	}
	groups := map[key][]Result{}
	var keys []key
	for _, r := range rows {
		k := key{r.Peer, r.Concurrency, r.Phase}
		if _, ok := groups[k]; !ok {
			keys = append(keys, k)
		}
		groups[k] = append(groups[k], r)
	}
	order := func(p string) int {
		if i := slices.Index(Names, p); i >= 0 {
			return i
		}
		return len(Names)
	}
	slices.SortFunc(keys, func(a, b key) int {
		if c := order(a.peer) - order(b.peer); c != 0 {
			return c
		}
		if c := strings.Compare(a.peer, b.peer); c != 0 {
			return c
		}
		if c := a.conc - b.conc; c != 0 {
			return c
		}
		return -strings.Compare(a.phase, b.phase) // "fresh" before "duplicate"
	})
	var out []Median
	for _, k := range keys {
		g := groups[k]
		col := func(f func(r *Result) float64) float64 {
			var vs []float64
			for i := range g {
				if v := f(&g[i]); v > 0 {
					vs = append(vs, v)
				}
			}
			return median(vs)
		}
		m := Median{Peer: k.peer, Concurrency: k.conc, Phase: k.phase, Rounds: len(g),
			PerSec:      col(func(r *Result) float64 { return r.PerSec }),
			P50us:       col(func(r *Result) float64 { return r.P50us }),
			P99us:       col(func(r *Result) float64 { return r.P99us }),
			P999us:      col(func(r *Result) float64 { return r.P999us }),
			CPUusPerReq: col(func(r *Result) float64 { return r.CPUusPerReq }),
			Ratio:       col(func(r *Result) float64 { return r.Ratio }),
			BaseOver: col(func(r *Result) float64 {
				if r.Ratio <= 0 {
					return 0
				}
				return 1 / r.Ratio
			}),
		}
		m.MinPerSec, m.MaxPerSec = g[0].PerSec, g[0].PerSec
		for _, r := range g {
			m.Errors += r.Errors
			m.MinPerSec, m.MaxPerSec = min(m.MinPerSec, r.PerSec), max(m.MaxPerSec, r.PerSec)
		}
		out = append(out, m)
	}
	return out
}

func median(vs []float64) float64 {
	if len(vs) == 0 {
		return 0
	}
	vs = slices.Clone(vs)
	slices.Sort(vs)
	n := len(vs)
	if n%2 == 1 {
		return vs[n/2]
	}
	return (vs[n/2-1] + vs[n/2]) / 2
}

// MedianHeader is the CSV header of WriteMediansCSV.
func MedianHeader(base string) []string {
	return []string{"peer", "concurrency", "phase", "rounds", "errors", "req_per_s_median",
		"req_per_s_min", "req_per_s_max", "p50_us", "p99_us", "p999_us", "cpu_us_per_req", "ratio_to_" + base}
}

// WriteMediansCSV writes medians as CSV (their ratios are to base).
func WriteMediansCSV(w io.Writer, ms []Median, base string) error {
	cw := csv.NewWriter(w)
	if err := cw.Write(MedianHeader(base)); err != nil {
		return err
	}
	for _, m := range ms {
		ratio := ""
		if m.Ratio > 0 {
			ratio = f64(m.Ratio, 4)
		}
		if err := cw.Write([]string{m.Peer, strconv.Itoa(m.Concurrency), m.Phase, strconv.Itoa(m.Rounds),
			strconv.FormatUint(m.Errors, 10), f64(m.PerSec, 1), f64(m.MinPerSec, 1), f64(m.MaxPerSec, 1),
			f64(m.P50us, 1), f64(m.P99us, 1), f64(m.P999us, 1), f64(m.CPUusPerReq, 2), ratio}); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

// WriteMarkdown writes the medians as markdown tables: for each phase a
// summary (a row per peer, a column per concurrency: requests/s and the
// ratio to the peer base), then the details (a row per peer and
// concurrency).
func WriteMarkdown(w io.Writer, ms []Median, base string) error {
	writePivot(w, ms, base)
	writeBaseOver(w, ms, base)
	for _, phase := range []string{"fresh", "duplicate"} {
		var rows []Median
		for _, m := range ms {
			if m.Phase == phase {
				rows = append(rows, m)
			}
		}
		if len(rows) == 0 {
			continue
		}
		fmt.Fprintf(w, "\n%s requests, medians over %d round(s):\n\n", strings.ToUpper(phase[:1])+phase[1:], rows[0].Rounds)
		fmt.Fprintf(w, "| peer | callers | req/s (min - max) | ratio to %s | p50 | p99 | p99.9 | CPU µs/req |\n", base)
		fmt.Fprintln(w, "|---|---:|---:|---:|---:|---:|---:|---:|")
		for _, m := range rows {
			ratio := "-"
			if m.Ratio > 0 {
				ratio = ratioStr(m.Ratio)
			}
			errs := ""
			if m.Errors > 0 {
				errs = fmt.Sprintf(" (%d errors)", m.Errors)
			}
			fmt.Fprintf(w, "| %s | %d | %s (%s - %s)%s | %s | %s | %s | %s | %.1f |\n", m.Peer, m.Concurrency,
				group(m.PerSec), group(m.MinPerSec), group(m.MaxPerSec), errs, ratio,
				dur(m.P50us), dur(m.P99us), dur(m.P999us), m.CPUusPerReq)
		}
	}
	return nil
}

// writePivot writes, per phase, requests/s (ratio to base) with a row per
// peer and a column per concurrency.
func writePivot(w io.Writer, ms []Median, base string) {
	for _, phase := range []string{"fresh", "duplicate"} {
		var concs []int
		var names []string
		cell := map[string]map[int]Median{}
		for _, m := range ms {
			if m.Phase != phase {
				continue
			}
			if !slices.Contains(concs, m.Concurrency) {
				concs = append(concs, m.Concurrency)
			}
			if cell[m.Peer] == nil {
				cell[m.Peer] = map[int]Median{}
				names = append(names, m.Peer)
			}
			cell[m.Peer][m.Concurrency] = m
		}
		if len(names) == 0 {
			continue
		}
		slices.Sort(concs)
		title := map[string]string{"fresh": "Fresh requests/s", "duplicate": "Duplicate hits/s"}[phase]
		fmt.Fprintf(w, "\n%s, median (ratio to %s), by concurrent callers:\n\n| peer |", title, base)
		for _, c := range concs {
			fmt.Fprintf(w, " %d |", c)
		}
		fmt.Fprint(w, "\n|---|")
		for range concs {
			fmt.Fprint(w, "---:|")
		}
		fmt.Fprintln(w)
		for _, n := range names {
			fmt.Fprintf(w, "| %s |", n)
			for _, c := range concs {
				m, ok := cell[n][c]
				switch {
				case !ok:
					fmt.Fprint(w, " - |")
				case n == base || m.Ratio == 0:
					fmt.Fprintf(w, " %s |", group(m.PerSec))
				default:
					fmt.Fprintf(w, " %s (%s) |", group(m.PerSec), ratioStr(m.Ratio))
				}
			}
			fmt.Fprintln(w)
		}
	}
}

// writeBaseOver writes, per phase, the base peer's requests/s over each
// other peer's (the median of the per-round ratios), a row per peer and a
// column per concurrency: how many times faster (or slower) the base is.
func writeBaseOver(w io.Writer, ms []Median, base string) {
	fmt.Fprintf(w, "\n%s's requests/s over each peer's (median of the per-round ratios), by concurrent callers:\n\n", base)
	var concs []int
	for _, m := range ms {
		if !slices.Contains(concs, m.Concurrency) {
			concs = append(concs, m.Concurrency)
		}
	}
	slices.Sort(concs)
	fmt.Fprint(w, "| peer | phase |")
	for _, c := range concs {
		fmt.Fprintf(w, " %d |", c)
	}
	fmt.Fprint(w, "\n|---|---|")
	for range concs {
		fmt.Fprint(w, "---:|")
	}
	fmt.Fprintln(w)
	for _, phase := range []string{"fresh", "duplicate"} {
		var names []string
		cell := map[string]map[int]float64{}
		for _, m := range ms {
			if m.Phase != phase || m.Peer == base || m.BaseOver <= 0 {
				continue
			}
			if cell[m.Peer] == nil {
				cell[m.Peer] = map[int]float64{}
				names = append(names, m.Peer)
			}
			cell[m.Peer][m.Concurrency] = m.BaseOver
		}
		for _, n := range names {
			fmt.Fprintf(w, "| %s | %s |", n, phase)
			for _, c := range concs {
				if v, ok := cell[n][c]; ok {
					fmt.Fprintf(w, " %s |", ratioStr(v))
				} else {
					fmt.Fprint(w, " - |")
				}
			}
			fmt.Fprintln(w)
		}
	}
}

// ratioStr formats a ratio: two decimals, or two significant digits
// below 0.1.
func ratioStr(r float64) string {
	switch {
	case r >= 10:
		return fmt.Sprintf("%.0f×", r)
	case r >= 0.1:
		return fmt.Sprintf("%.2f×", r)
	}
	return fmt.Sprintf("%.2g×", r)
}

// group formats v rounded to an integer with thousands separators.
func group(v float64) string {
	s := strconv.FormatInt(int64(v+0.5), 10)
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String()
}

// dur formats microseconds as µs or ms.
func dur(us float64) string {
	switch {
	case us <= 0:
		return "-"
	case us < 1000:
		return fmt.Sprintf("%.0f µs", us)
	case us < 10000:
		return fmt.Sprintf("%.2f ms", us/1000)
	default:
		return fmt.Sprintf("%.0f ms", us/1000)
	}
}
