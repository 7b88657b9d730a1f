package idemhttp

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// recorder is the ResponseWriter the handler of a fresh key writes to. It
// buffers the response so that it can be stored before anything is sent.
// Past limit bytes of body it gives up storing and streams: what it holds is
// sent, and every later write goes straight to the client (the key is then
// committed as "not stored" when the handler returns).
type recorder struct {
	w     http.ResponseWriter
	rc    *http.ResponseController
	limit int

	header      http.Header // what the handler sees
	snapshot    http.Header // header at the time the status was written
	status      int         // 0 until written
	body        []byte
	wroteAny    bool // WriteHeader or Write was called
	streaming   bool // past the limit: writes go to w
	streamErr   error
	bodyAllowed bool
}

func newRecorder(w http.ResponseWriter, limit int) *recorder {
	return &recorder{w: w, rc: http.NewResponseController(w), limit: limit, header: make(http.Header)}
}

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(code int) {
	// net/http's own rule: a code outside 100-999 is a programming error.
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code))
	}
	r.wroteAny = true
	if r.status != 0 {
		return // superfluous, as net/http ignores it
	}
	if code < 200 {
		// Informational responses (100 Continue, 103 Early Hints) are not
		// part of the stored response and are not sent.
		return
	}
	r.status = code
	r.snapshot = r.header.Clone()
	r.bodyAllowed = bodyAllowed(code)
}

func bodyAllowed(code int) bool {
	return !(code >= 100 && code < 200 || code == http.StatusNoContent || code == http.StatusNotModified)
}

func (r *recorder) Write(p []byte) (int, error) {
	if r.status == 0 {
		r.WriteHeader(http.StatusOK)
	}
	r.wroteAny = true
	if !r.bodyAllowed {
		return 0, http.ErrBodyNotAllowed
	}
	if r.streaming {
		if r.streamErr != nil {
			return 0, r.streamErr
		}
		n, err := r.w.Write(p)
		r.streamErr = err
		return n, err
	}
	if len(r.body)+len(p) > r.limit {
		return r.startStreaming(p)
	}
	r.body = append(r.body, p...)
	return len(p), nil
}

// WriteString lets io.WriteString skip a copy.
func (r *recorder) WriteString(s string) (int, error) {
	if r.streaming || len(r.body)+len(s) > r.limit || r.status == 0 || !r.bodyAllowed {
		return r.Write([]byte(s))
	}
	r.wroteAny = true
	r.body = append(r.body, s...)
	return len(s), nil
}

// startStreaming sends the status, the header and what is buffered, then p.
func (r *recorder) startStreaming(p []byte) (int, error) {
	r.streaming = true
	copyHeader(r.w.Header(), r.snapshot)
	r.w.WriteHeader(r.status)
	if len(r.body) > 0 {
		if _, err := r.w.Write(r.body); err != nil {
			r.streamErr = err
			return 0, err
		}
	}
	r.body = nil
	n, err := r.w.Write(p)
	r.streamErr = err
	return n, err
}

// Flush is a no-op while the response is buffered (it reaches the client
// once stored, see the package documentation); once streaming it flushes.
func (r *recorder) Flush() { _ = r.FlushError() }

// FlushError is what http.ResponseController.Flush calls.
func (r *recorder) FlushError() error {
	if !r.streaming {
		return nil
	}
	if r.streamErr != nil {
		return r.streamErr
	}
	return r.rc.Flush()
}

// SetReadDeadline and SetWriteDeadline reach the connection through
// http.ResponseController (the body was read already; the write deadline
// still bounds sending the response).
func (r *recorder) SetReadDeadline(t time.Time) error  { return r.rc.SetReadDeadline(t) }
func (r *recorder) SetWriteDeadline(t time.Time) error { return r.rc.SetWriteDeadline(t) }

// finalStatus is the status net/http would send for what the handler did.
func (r *recorder) finalStatus() int {
	if r.status == 0 {
		return http.StatusOK
	}
	return r.status
}

// stored returns the response to store (not streaming).
func (r *recorder) stored() *StoredResponse {
	status := r.finalStatus()
	h := r.snapshot
	if h == nil { // nothing written: net/http sends the header as it is now
		h = r.header.Clone()
	}
	return &StoredResponse{Status: status, Header: h, Body: r.body, Trailer: trailers(h, r.header)}
}

// trailers picks from the handler's final header the trailers: names
// announced in the "Trailer" header of the sent header, and keys with
// http.TrailerPrefix.
func trailers(sent, final http.Header) http.Header {
	var t http.Header
	add := func(k string, v []string) {
		if t == nil {
			t = make(http.Header)
		}
		t[k] = append([]string(nil), v...)
	}
	for _, decl := range sent.Values("Trailer") {
		for name := range strings.SplitSeq(decl, ",") {
			name = http.CanonicalHeaderKey(strings.TrimSpace(name))
			if v, ok := final[name]; ok && name != "" {
				add(name, v)
			}
		}
	}
	for k, v := range final {
		if strings.HasPrefix(k, http.TrailerPrefix) {
			add(k, v)
		}
	}
	return t
}

// copyHeader sets every key of src in dst (replacing dst's values).
func copyHeader(dst, src http.Header) {
	for k, v := range src {
		dst[k] = v
	}
}

// sendStored writes a stored response to w: the header, Content-Length when
// the handler set none (so a replay and the first response look the same),
// the body, then the trailers.
func sendStored(w http.ResponseWriter, s *StoredResponse, replayed bool) error {
	h := w.Header()
	copyHeader(h, s.Header)
	if replayed {
		h.Set(HeaderReplayed, "true")
	}
	if bodyAllowed(s.Status) && h.Get("Content-Length") == "" && h.Get("Transfer-Encoding") == "" && h.Get("Trailer") == "" && !hasPrefixedTrailer(s.Trailer) {
		h.Set("Content-Length", strconv.Itoa(len(s.Body)))
	}
	w.WriteHeader(s.Status)
	var err error
	if len(s.Body) > 0 && bodyAllowed(s.Status) {
		_, err = w.Write(s.Body)
	}
	copyHeader(h, s.Trailer)
	return err
}

func hasPrefixedTrailer(t http.Header) bool {
	for k := range t {
		if strings.HasPrefix(k, http.TrailerPrefix) {
			return true
		}
	}
	return false
}
