package natsfence

import (
	"context"

	"github.com/nats-io/nats.go/jetstream"
)

// Options is the former name of AcquirerOptions.
//
// Deprecated: use AcquirerOptions.
type Options = AcquirerOptions

// New returns an Acquirer, as NewAcquirer does.
//
// Deprecated: use NewAcquirer.
func New(ctx context.Context, js jetstream.JetStream, bucket string, opts *AcquirerOptions) (*Acquirer, error) {
	return NewAcquirer(ctx, js, bucket, opts)
}

// Store is the former name of IdempotencyStore.
//
// Deprecated: use IdempotencyStore.
type Store = IdempotencyStore

// StoreOptions is the former name of IdempotencyOptions.
//
// Deprecated: use IdempotencyOptions.
type StoreOptions = IdempotencyOptions

// NewStore returns an IdempotencyStore, as NewIdempotencyStore does.
//
// Deprecated: use NewIdempotencyStore.
func NewStore(ctx context.Context, js jetstream.JetStream, bucket string, opts *IdempotencyOptions) (*IdempotencyStore, error) {
	return NewIdempotencyStore(ctx, js, bucket, opts)
}
