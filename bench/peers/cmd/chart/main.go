// Command chart draws the peers benchmark (the CSV written by `peers
// summary`) as an SVG: fresh requests/s and duplicate hits/s of every peer
// against the number of concurrent callers, medians over the rounds, both
// axes logarithmic. The same command draws the embedded stores' run
// (docs/peers.svg) and the shared stores' (docs/peers-shared.svg).
//
//	go run ./cmd/chart -in ../../docs/peers.csv -env ../../docs/peers-env.txt -out ../../docs/peers.svg
//	go run ./cmd/chart -in ../../docs/peers-shared.csv -env ../../docs/peers-shared-env.txt -out ../../docs/peers-shared.svg
//
// An -out ending in .png writes a PNG instead (to look at it where no SVG
// viewer is at hand).
package main

import (
	"bufio"
	"bytes"
	"errors"
	"flag"
	"fmt"
	"image/color"
	"math"
	"os"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"

	"github.com/idemdb/idem/bench/peers"
)

func main() {
	in := flag.String("in", "", "CSV written by `peers summary -csv` (or by `peers run`)")
	env := flag.String("env", "", "peers-env.txt written by run.sh (date and machine, shown under the chart)")
	out := flag.String("out", "peers.svg", "output `file` (.svg or .png)")
	flag.Parse()
	// Liberation Sans has the metrics of Arial and Helvetica: the SVG
	// names those as fallbacks (see fontFallbacks), so text drawn by a
	// browser without Liberation fits the layout computed here.
	plot.DefaultFont = font.Font{Typeface: "Liberation", Variant: "Sans"}
	if err := draw2(*in, *env, *out); err != nil {
		fmt.Fprintln(os.Stderr, "chart:", err)
		os.Exit(1)
	}
}

// style of each peer's line: idem stands out, the file-append limit is a
// dashed grey line.
type lineStyle struct {
	color color.Color
	width vg.Length
	dash  []vg.Length
	glyph draw.GlyphDrawer
}

var styles = map[string]lineStyle{
	"idem":        {color.RGBA{0xd6, 0x27, 0x28, 0xff}, 2.5, nil, draw.CircleGlyph{}},
	"idemcluster": {color.RGBA{0x7b, 0x10, 0x50, 0xff}, 2.5, nil, draw.RingGlyph{}},
	"etcd":        {color.RGBA{0x17, 0xbe, 0xcf, 0xff}, 1.5, nil, draw.SquareGlyph{}},
	"pebble":      {color.RGBA{0x1f, 0x77, 0xb4, 0xff}, 1.5, nil, draw.SquareGlyph{}},
	"bbolt":       {color.RGBA{0x2c, 0xa0, 0x2c, 0xff}, 1.5, nil, draw.TriangleGlyph{}},
	"sqlite":      {color.RGBA{0x94, 0x67, 0xbd, 0xff}, 1.5, nil, draw.PyramidGlyph{}},
	"redis":       {color.RGBA{0xff, 0x7f, 0x0e, 0xff}, 1.5, nil, draw.BoxGlyph{}},
	"postgres":    {color.RGBA{0x8c, 0x56, 0x4b, 0xff}, 1.5, nil, draw.CrossGlyph{}},
	"file":        {color.RGBA{0x60, 0x60, 0x60, 0xff}, 1.5, []vg.Length{vg.Points(5), vg.Points(3)}, draw.RingGlyph{}},
}

var legendNames = map[string]string{
	"idem":        "idem (embedded)",
	"idemcluster": "idem cluster (3 nodes)",
	"etcd":        "etcd (3 members)",
	"pebble":      "Pebble (direct)",
	"bbolt":       "bbolt",
	"sqlite":      "SQLite (WAL, FULL)",
	"redis":       "Redis (fsync always)",
	"postgres":    "PostgreSQL (sync commit)",
	"file":        "append + fdatasync (limit)",
}

func draw2(in, envPath, out string) error {
	if in == "" {
		return errors.New("-in is required")
	}
	f, err := os.Open(in)
	if err != nil {
		return err
	}
	rows, err := peers.ReadCSV(f)
	f.Close()
	if err != nil {
		return fmt.Errorf("%s: %w", in, err)
	}
	if len(rows) == 0 {
		return fmt.Errorf("%s: no rows", in)
	}
	ms := peers.Medians(rows)
	rounds := 0
	for _, m := range ms {
		rounds = max(rounds, m.Rounds)
	}

	var panels []*plot.Plot
	for _, ph := range []struct{ phase, title string }{
		{"fresh", "Fresh requests/s (claim and reply on disk)"},
		{"duplicate", "Duplicate hits/s (the stored reply returned)"},
	} {
		p, err := panel(ms, ph.phase, ph.title, len(panels) == 0)
		if err != nil {
			return err
		}
		if p != nil {
			panels = append(panels, p)
		}
	}
	if len(panels) == 0 {
		return fmt.Errorf("%s: no rows with requests", in)
	}

	plural := "s"
	if rounds == 1 {
		plural = ""
	}
	caption := fmt.Sprintf("Median of %d round%s; 16-byte random ids, 128-byte replies; every peer waits for the disk (fsync) before going on", rounds, plural)
	if slices.ContainsFunc(ms, func(m peers.Median) bool { return m.Peer == "idemcluster" || m.Peer == "etcd" }) {
		caption += "; a cluster (3 members in one process, one disk) for a majority's"
	}
	caption += "."
	if envPath != "" {
		env, err := readEnv(envPath)
		if err != nil {
			return err
		}
		if env.command == "" {
			env.command = "bash bench/peers/run.sh"
		}
		caption += "\nMeasured " + env.date + " on " + env.machine
		if env.loadBefore != "" && env.loadAfter != "" {
			caption += "; load average " + env.loadBefore + " before the run, " + env.loadAfter + " after"
		}
		caption += ".\nRegenerate: " + env.command
	}

	const w, h = 26 * vg.Centimeter, 12.4 * vg.Centimeter
	var c vg.CanvasWriterTo
	switch {
	case strings.HasSuffix(out, ".svg"):
		c = vgsvg.New(w, h)
	case strings.HasSuffix(out, ".png"):
		c = vgimg.PngCanvas{Canvas: vgimg.NewWith(vgimg.UseWH(w, h), vgimg.UseDPI(110), vgimg.UseBackgroundColor(color.White))}
	default:
		return fmt.Errorf("-out %s: want a .svg or .png file", out)
	}
	dc := draw.New(c)
	dc.FillPolygon(color.White, []vg.Point{{X: dc.Min.X, Y: dc.Min.Y}, {X: dc.Max.X, Y: dc.Min.Y}, {X: dc.Max.X, Y: dc.Max.Y}, {X: dc.Min.X, Y: dc.Max.Y}})
	const captionH = 1.6 * vg.Centimeter
	charts := draw.Crop(dc, 0, 0, captionH, 0)
	tiles := draw.Tiles{Rows: 1, Cols: len(panels), PadX: vg.Centimeter, PadTop: vg.Points(6), PadBottom: vg.Points(4), PadLeft: vg.Points(4), PadRight: vg.Points(8)}
	cs := plot.Align([][]*plot.Plot{panels}, tiles, charts)
	for i, p := range panels {
		p.Draw(cs[0][i])
	}

	sty := panels[0].X.Label.TextStyle
	sty.Font.Size = vg.Points(8.5)
	sty.XAlign, sty.YAlign = draw.XLeft, draw.YTop
	dc.FillText(sty, vg.Point{X: dc.Min.X + vg.Points(8), Y: dc.Min.Y + captionH - vg.Points(4)}, caption)

	var buf bytes.Buffer
	if _, err := c.WriteTo(&buf); err != nil {
		return err
	}
	img := buf.Bytes()
	if strings.HasSuffix(out, ".svg") {
		img = fontFallbacks(img)
	}
	return os.WriteFile(out, img, 0o644)
}

// fontFallbacks names Arial, Helvetica and sans-serif after Liberation Sans
// in the SVG's font-family properties.
func fontFallbacks(svg []byte) []byte {
	return bytes.ReplaceAll(svg, []byte("font-family:Liberation Sans"),
		[]byte("font-family:'Liberation Sans',Arial,Helvetica,sans-serif"))
}

// panel is one chart: requests/s of every peer against callers (nil if
// no peer has a row of the phase).
func panel(ms []peers.Median, phase, title string, legend bool) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = title
	p.Title.TextStyle.Font.Size = vg.Points(11)
	p.X.Label.Text = "concurrent callers"
	p.Y.Label.Text = "requests/s"
	p.X.Scale = plot.LogScale{}
	p.Y.Scale = plot.LogScale{}
	p.Add(plotter.NewGrid())

	byPeer := map[string]plotter.XYs{}
	var order []string
	var xs []float64
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, m := range ms {
		if m.Phase != phase || m.PerSec <= 0 {
			continue
		}
		if _, ok := byPeer[m.Peer]; !ok {
			order = append(order, m.Peer)
		}
		byPeer[m.Peer] = append(byPeer[m.Peer], plotter.XY{X: float64(m.Concurrency), Y: m.PerSec})
		if !slices.Contains(xs, float64(m.Concurrency)) {
			xs = append(xs, float64(m.Concurrency))
		}
		lo, hi = min(lo, m.PerSec), max(hi, m.PerSec)
	}
	if len(order) == 0 {
		return nil, nil
	}
	slices.Sort(xs)
	var xt []plot.Tick
	for _, x := range xs {
		xt = append(xt, plot.Tick{Value: x, Label: fmt.Sprint(x)})
	}
	p.X.Tick.Marker = plot.ConstantTicks(xt)
	p.X.Min, p.X.Max = xs[0]/1.3, xs[len(xs)-1]*1.3
	// Decades (1, 10, 100, ... as 1, 10, 100, 1k, 10k, ...), with the
	// 2 and 5 of each decade as unlabeled minor ticks.
	ymin := math.Pow(10, math.Floor(math.Log10(lo)))
	ymax := math.Pow(10, math.Ceil(math.Log10(hi)))
	if legend {
		ymax *= 10 // room for the legend above the lines
	}
	var yt []plot.Tick
	for d := ymin; d <= ymax*1.0001; d *= 10 {
		yt = append(yt, plot.Tick{Value: d, Label: si(d)})
		for _, k := range []float64{2, 5} {
			if d*k < ymax {
				yt = append(yt, plot.Tick{Value: d * k})
			}
		}
	}
	p.Y.Tick.Marker = plot.ConstantTicks(yt)
	p.Y.Min, p.Y.Max = ymin, ymax

	for _, name := range order {
		st, ok := styles[name]
		if !ok {
			st = lineStyle{color.Black, 1, nil, draw.CircleGlyph{}}
		}
		l, pts, err := plotter.NewLinePoints(byPeer[name])
		if err != nil {
			return nil, err
		}
		l.Color, l.Width, l.Dashes = st.color, vg.Points(float64(st.width)), st.dash
		pts.Color, pts.Shape, pts.Radius = st.color, st.glyph, vg.Points(3)
		p.Add(l, pts)
		if legend {
			label := legendNames[name]
			if label == "" {
				label = name
			}
			p.Legend.Add(label, l, pts)
		}
	}
	if legend {
		p.Legend.Top, p.Legend.Left = true, true
		p.Legend.XOffs, p.Legend.YOffs = vg.Points(6), -vg.Points(4)
		p.Legend.TextStyle.Font.Size = vg.Points(8.5)
		p.Legend.Padding = vg.Points(1)
	}
	return p, nil
}

// si formats a power of ten as 1, 10, 100, 1k, 10k, 100k, 1M, ...
func si(v float64) string {
	switch {
	case v >= 1e6:
		return fmt.Sprintf("%gM", v/1e6)
	case v >= 1e3:
		return fmt.Sprintf("%gk", v/1e3)
	}
	return fmt.Sprintf("%g", v)
}

// runEnv is what the chart shows of run.sh's peers-env.txt.
type runEnv struct {
	date, machine         string // the day; cores, CPU, memory, kernel, file system
	command               string // empty if the file has none
	loadBefore, loadAfter string // 1-minute load averages, empty if none
}

// readEnv reads run.sh's peers-env.txt.
func readEnv(path string) (runEnv, error) {
	var e runEnv
	f, err := os.Open(path)
	if err != nil {
		return e, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ": ")
		switch {
		case !ok:
		case k == "date":
			e.date, _, _ = strings.Cut(v, "T")
		case k == "machine":
			e.machine = v
		case k == "command":
			e.command = v
		case k == "stores":
			fs, _, _ := strings.Cut(v, " on ")
			if fs != "" {
				e.machine += ", stores on " + fs
			}
		case k == "load average before the run":
			e.loadBefore, _, _ = strings.Cut(v, " ")
		case k == "load average after the run":
			e.loadAfter, _, _ = strings.Cut(v, " ")
		}
	}
	if err := sc.Err(); err != nil {
		return e, err
	}
	if e.date == "" || e.machine == "" {
		return e, fmt.Errorf("%s: no date: or machine: line", path)
	}
	return e, nil
}
