package azfence

import "github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/container"

// Options is the former name of WriterOptions.
//
// Deprecated: use WriterOptions.
type Options = WriterOptions

// New returns a Writer, as NewWriter does.
//
// Deprecated: use NewWriter.
func New(c *container.Client, opts *WriterOptions) (*Writer, error) {
	return NewWriter(c, opts)
}
