// Command coredns is CoreDNS with only the plugins the test cluster's DNS
// needs: cluster.local names from the API server (kubernetes), bind (node
// 1's address only), errors, log and ready (what hack/cluster waits on).
// Nothing is forwarded: there is nowhere outside the cluster's network
// namespace to ask.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

// The order plugins run in (CoreDNS's plugin.cfg order, trimmed to these).
var directives = []string{"bind", "ready", "errors", "log", "kubernetes"}

func init() { dnsserver.Directives = directives }

func main() { coremain.Run() }
