package gcsfence

import "cloud.google.com/go/storage"

// Options is the former name of WriterOptions.
//
// Deprecated: use WriterOptions.
type Options = WriterOptions

// New returns a Writer, as NewWriter does.
//
// Deprecated: use NewWriter.
func New(bucket *storage.BucketHandle, opts *WriterOptions) (*Writer, error) {
	return NewWriter(bucket, opts)
}
