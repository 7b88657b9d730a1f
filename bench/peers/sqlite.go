package peers

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"path/filepath"
	"runtime"

	_ "modernc.org/sqlite" // database/sql driver "sqlite"
)

// sqlitePeer is a SQLite database (modernc.org/sqlite, pure Go) in WAL mode
// with synchronous=FULL, so that every commit fsyncs the WAL before it
// returns. Each statement is its own transaction: SELECT the id; INSERT
// the claim with ON CONFLICT DO NOTHING (one row affected = this caller
// claimed it); run; UPDATE the row with the reply.
//
// Pools: SQLite lets one connection write at a time. More writing
// connections would not write more, only wait on the database lock in
// SQLite's busy handler (which polls with sleeps); so all writes go
// through one connection and queue in database/sql instead. Reads run
// concurrently with the writer in WAL mode, on their own pool of
// 2*GOMAXPROCS connections: a lookup is CPU work on cached pages, and
// more connections than that would only add memory.
type sqlitePeer struct {
	w, r               *sql.DB
	get, claim, commit *sql.Stmt
}

func openSQLite(ctx context.Context, cfg Config) (Peer, error) {
	path := filepath.Join(cfg.Dir, "sqlite.db")
	q := url.Values{}
	q.Add("_pragma", "journal_mode(WAL)")
	q.Add("_pragma", "synchronous(FULL)")
	q.Add("_pragma", "busy_timeout(10000)")
	dsn := "file:" + path + "?" + q.Encode()
	w, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, err
	}
	w.SetMaxOpenConns(1)
	w.SetMaxIdleConns(1)
	p := &sqlitePeer{w: w}
	if _, err := w.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS req (
		id BLOB PRIMARY KEY, state INTEGER NOT NULL, reply BLOB) WITHOUT ROWID`); err != nil {
		p.Close()
		return nil, fmt.Errorf("sqlite: create table: %w", err)
	}
	r, err := sql.Open("sqlite", dsn)
	if err != nil {
		p.Close()
		return nil, err
	}
	p.r = r
	readers := min(2*runtime.GOMAXPROCS(0), cfg.Concurrency)
	r.SetMaxOpenConns(readers)
	r.SetMaxIdleConns(readers)
	for _, s := range []struct {
		db  *sql.DB
		dst **sql.Stmt
		q   string
	}{
		{r, &p.get, `SELECT state, reply FROM req WHERE id = ?`},
		{w, &p.claim, `INSERT INTO req (id, state) VALUES (?, 0) ON CONFLICT DO NOTHING`},
		{w, &p.commit, `UPDATE req SET state = 1, reply = ? WHERE id = ?`},
	} {
		if *s.dst, err = s.db.PrepareContext(ctx, s.q); err != nil {
			p.Close()
			return nil, fmt.Errorf("sqlite: prepare %q: %w", s.q, err)
		}
	}
	return p, nil
}

// lookup returns the stored reply (fresh == false) or found == false.
func (p *sqlitePeer) lookup(ctx context.Context, id []byte) (reply []byte, found bool, err error) {
	var state int
	if err := p.get.QueryRowContext(ctx, id).Scan(&state, &reply); err != nil {
		if errors.Is(err, sql.ErrNoRows) {
			return nil, false, nil
		}
		return nil, false, err
	}
	if state != 1 {
		return nil, true, ErrInFlight
	}
	return reply, true, nil
}

func (p *sqlitePeer) Do(ctx context.Context, id []byte, fn func() []byte) ([]byte, bool, error) {
	if reply, found, err := p.lookup(ctx, id); found || err != nil {
		return reply, false, err
	}
	res, err := p.claim.ExecContext(ctx, id)
	if err != nil {
		return nil, false, err
	}
	if n, err := res.RowsAffected(); err != nil || n != 1 {
		if err != nil {
			return nil, false, err
		}
		reply, _, err := p.lookup(ctx, id) // claimed by another caller meanwhile
		return reply, false, err
	}
	reply := fn()
	if _, err := p.commit.ExecContext(ctx, reply, id); err != nil {
		return nil, false, err
	}
	return reply, true, nil
}

func (p *sqlitePeer) Close() error {
	var errs []error
	for _, s := range []*sql.Stmt{p.get, p.claim, p.commit} {
		if s != nil {
			errs = append(errs, s.Close())
		}
	}
	if p.r != nil {
		errs = append(errs, p.r.Close())
	}
	errs = append(errs, p.w.Close())
	return errors.Join(errs...)
}
