package idemraft

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"

	"github.com/hashicorp/raft"
	"github.com/vmihailenco/msgpack/v5"
)

// HTTP headers of Handler's answers.
const (
	HeaderNode   = "Idemraft-Node"   // the id of the node that answered
	HeaderLeader = "Idemraft-Leader" // the leader's id, on 421
)

const contentType = "application/vnd.msgpack"

// Handler serves Submit over HTTP for the node r (id id) whose FSM is f,
// for HTTPNode clients: POST a command (the bytes of Command) as the body.
//
//   - 200: the Response, msgpack-encoded (HTTPNode decodes it);
//   - 421 Misdirected Request: not the leader; the Idemraft-Leader header
//     names the leader when known;
//   - 400: not a command; 405: not a POST; 413: body too large;
//   - 503: the outcome is unknown (leadership lost, timeout, shutdown):
//     retry the same command.
//
// It is an internal API for trusted clients of the cluster: it applies any
// command it is given. Put the application's own API (authentication,
// choosing ids and scopes from the caller's identity) in front of it.
//
// It returns an error if id is empty or r or f is nil.
func Handler(id raft.ServerID, r *raft.Raft, f *FSM) (http.Handler, error) {
	if err := checkServer("Handler", id, r, f); err != nil {
		return nil, err
	}
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		w.Header().Set(HeaderNode, string(id))
		if req.Method != http.MethodPost {
			w.Header().Set("Allow", http.MethodPost)
			http.Error(w, "idemraft: POST a command", http.StatusMethodNotAllowed)
			return
		}
		body, err := io.ReadAll(io.LimitReader(req.Body, MaxCommandSize+1))
		if err != nil {
			http.Error(w, "idemraft: reading the body: "+err.Error(), http.StatusBadRequest)
			return
		}
		if len(body) > MaxCommandSize {
			http.Error(w, fmt.Sprintf("idemraft: command larger than %d bytes", MaxCommandSize), http.StatusRequestEntityTooLarge)
			return
		}
		resp, err := Submit(req.Context(), r, f, body)
		var nl *NotLeaderError
		switch {
		case err == nil:
			b, err := msgpack.Marshal(toWire(resp))
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.Header().Set("Content-Type", contentType)
			w.Write(b)
		case errors.As(err, &nl):
			w.Header().Set(HeaderLeader, string(nl.Leader))
			http.Error(w, fmt.Sprintf("idemraft: node %s is not the leader (leader: %q)", id, nl.Leader), http.StatusMisdirectedRequest)
		case errors.Is(err, ErrInvalidCommand):
			http.Error(w, err.Error(), http.StatusBadRequest)
		default:
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
		}
	}), nil
}

// HTTPNode is a Node reached over HTTP: rawURL (http or https, with a
// host) is where its Handler is served. hc nil means http.DefaultClient.
func HTTPNode(id raft.ServerID, rawURL string, hc *http.Client) (Node, error) {
	if id == "" {
		return nil, fmt.Errorf("idemraft: HTTPNode %q: empty server id", rawURL)
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, fmt.Errorf("idemraft: HTTPNode %s: url %q: %w", id, rawURL, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("idemraft: HTTPNode %s: url %q: want http://host[:port]/path or https://...", id, rawURL)
	}
	if hc == nil {
		hc = http.DefaultClient
	}
	return &httpNode{id: id, url: rawURL, hc: hc}, nil
}

type httpNode struct {
	id  raft.ServerID
	url string
	hc  *http.Client
}

func (n *httpNode) ID() raft.ServerID { return n.id }

func (n *httpNode) Submit(ctx context.Context, cmd []byte) (*Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, n.url, bytes.NewReader(cmd))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", contentType)
	res, err := n.hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("idemraft: node %s: %w", n.id, err)
	}
	defer res.Body.Close()
	body, err := io.ReadAll(io.LimitReader(res.Body, MaxCommandSize+1<<20))
	if err != nil {
		return nil, fmt.Errorf("idemraft: node %s: reading the answer: %w", n.id, err)
	}
	switch res.StatusCode {
	case http.StatusOK:
		var wr wireResponse
		if err := unmarshalStrict(body, &wr); err != nil {
			return nil, fmt.Errorf("idemraft: node %s: undecodable answer: %w", n.id, err)
		}
		return fromWire(wr), nil
	case http.StatusMisdirectedRequest:
		return nil, &NotLeaderError{Node: n.id, Leader: raft.ServerID(res.Header.Get(HeaderLeader))}
	case http.StatusBadRequest:
		return nil, &remoteError{msg: strings.TrimSpace(string(body)), is: ErrInvalidCommand}
	default:
		return nil, fmt.Errorf("idemraft: node %s: %s: %s", n.id, res.Status, strings.TrimSpace(string(body)))
	}
}
