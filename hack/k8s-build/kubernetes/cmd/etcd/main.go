// Command etcd is etcd's own server command (go.etcd.io/etcd/server/v3
// etcdmain), built at the version k8s.io/kubernetes itself requires so that
// the API server runs against the etcd it was released with.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
