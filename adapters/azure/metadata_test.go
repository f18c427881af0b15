package azfence_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestWriteFenceSurvivesLoweredMetadata: a blob whose token metadata was set
// lower by another tool (Set Blob Metadata keeps the body and its envelope)
// still fences every token below the envelope's.
func TestWriteFenceSurvivesLoweredMetadata(t *testing.T) {
	e := newEnv(t)
	w := newWriter(t, e.c, nil)
	ctx := context.Background()
	key := fencetest.Name("meta")
	if err := w.Write(ctx, key, []byte("ten"), 10); err != nil {
		t.Fatal(err)
	}
	bc := e.c.NewBlobClient(key)
	p, err := bc.GetProperties(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	md := p.Metadata
	one := "1"
	for k := range md {
		if strings.EqualFold(k, azfence.MetaToken) {
			delete(md, k)
		}
	}
	md[azfence.MetaToken] = &one
	if _, err := bc.SetMetadata(ctx, md, nil); err != nil {
		t.Fatal(err)
	}
	var se *fence.StaleError
	if err := w.Write(ctx, key, []byte("five"), 5); !errors.As(err, &se) || se.Current != 10 {
		t.Errorf("Write(token 5) after token 10 and the token metadata set to 1: %v, want a StaleError holding 10", err)
	}
	if v, tok, err := w.Read(ctx, key); err != nil || string(v) != "ten" || tok != 10 {
		t.Errorf("Read = %q token %d, %v; want \"ten\" token 10", v, tok, err)
	}
	if err := w.Write(ctx, key, []byte("ten again"), 10); err != nil {
		t.Errorf("Write(token 10) again: %v", err)
	}
}

// TestLockSurvivesRemovedMetadata: a lock blob whose metadata another tool
// replaced (the token gone) between two grants still gives the next grant a
// token above the first.
func TestLockSurvivesRemovedMetadata(t *testing.T) {
	e := newEnv(t)
	a := newAcquirer(t, e.c)
	ctx := context.Background()
	name := fencetest.Name("meta")
	l, err := a.TryAcquire(ctx, name, 15*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	note := "by hand"
	if _, err := e.c.NewBlobClient("fencekit-locks/"+name).SetMetadata(ctx, map[string]*string{"note": &note}, nil); err != nil {
		t.Fatal(err)
	}
	l2, err := a.TryAcquire(ctx, name, 15*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Release(ctx)
	if l2.Token() <= l.Token() {
		t.Errorf("grant after the lock blob's metadata was replaced: token %d, want above %d", l2.Token(), l.Token())
	}
}

// TestLockSurvivesLoweredMetadata: a lock blob whose token metadata another
// tool set lower (Set Blob Metadata, no lease held) between two grants still
// gives the next grant a token above the first: a paused holder of the first
// grant must not beat the new holder at a fenced writer.
func TestLockSurvivesLoweredMetadata(t *testing.T) {
	e := newEnv(t)
	a := newAcquirer(t, e.c)
	ctx := context.Background()
	name := fencetest.Name("meta")
	l, err := a.TryAcquire(ctx, name, 15*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	bc := e.c.NewBlobClient("fencekit-locks/" + name)
	p, err := bc.GetProperties(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	md := map[string]*string{}
	for k, v := range p.Metadata {
		if !strings.EqualFold(k, azfence.MetaToken) {
			md[k] = v
		}
	}
	one := "1"
	md[azfence.MetaToken] = &one
	if _, err := bc.SetMetadata(ctx, md, nil); err != nil {
		t.Fatal(err)
	}
	l2, err := a.TryAcquire(ctx, name, 15*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Release(ctx)
	if l2.Token() <= l.Token() {
		t.Errorf("grant after the lock blob's token metadata was set to 1: token %d, want above the earlier grant's %d", l2.Token(), l.Token())
	}
}
