"""The cluster layer: what a node does as a member of a cluster, through the coordination store (etcd).

- `rules` — pure: gang generations, barriers, the group's restart policy, pause, redeploy duties, commands.
- `coordinator` — gang state and its etcd I/O; the node's `stackport.NodeLayer` (gate, decide, command, status).
- `ops` — the cluster redeploy and remote commands. `proxy_sync` — the PD proxy follows the gangs.
- `membership` — this node's member key and its view of the others; `consistency` — pure checks across them.
- `store` — the store's interface (stdlib only); `etcdstore` / `etcdlease` / `etcdclient` — it on real etcd.

Importing this package imports nothing: aetcd and gRPC load only with `etcdstore`, when `cluster.nodes` is set.
"""
