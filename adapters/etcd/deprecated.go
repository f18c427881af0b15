package etcdfence

import clientv3 "go.etcd.io/etcd/client/v3"

// Options is the former name of AcquirerOptions.
//
// Deprecated: use AcquirerOptions.
type Options = AcquirerOptions

// New returns an Acquirer on c, as NewAcquirer does.
//
// Deprecated: use NewAcquirer.
func New(c *clientv3.Client, opts *AcquirerOptions) (*Acquirer, error) {
	return NewAcquirer(c, opts)
}
