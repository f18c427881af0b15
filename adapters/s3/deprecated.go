package s3fence

// Options is the former name of WriterOptions.
//
// Deprecated: use WriterOptions.
type Options = WriterOptions

// New returns a Writer on bucket, as NewWriter does.
//
// Deprecated: use NewWriter.
func New(api API, bucket string, opts *WriterOptions) (*Writer, error) {
	return NewWriter(api, bucket, opts)
}
