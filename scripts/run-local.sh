#!/usr/bin/env bash
# Install and run the agent on the embedded local default: real etcd, the real datasystem worker and the vLLM
# stand-in on loopback, all state under .dsv4-agent/. Ctrl-C (SIGTERM) stops the stack in reverse order.
#   scripts/run-local.sh              one node (config/local.yaml)
#   scripts/run-local.sh --cluster    three agents from config/local-cluster.yaml (a prefill group, a decode group
#                                     of two nodes, the PD proxy), state under .dsv4-cluster/; Ctrl-C stops all
#   scripts/run-local.sh --container  the same one node in container mode: the worker and the stand-in inside a
#                                     podman container (image built offline from a cached Debian rootfs; needs
#                                     root, podman and runc), etcd on the host; Ctrl-C stops the container too
set -euo pipefail
cd "$(dirname "$0")/.."
cluster=false
container=false
if [ "${1:-}" = "--cluster" ]; then cluster=true; shift; fi
if [ "${1:-}" = "--container" ]; then container=true; shift; fi
extras=local
$cluster && extras=local,proxy
# Install only when pyproject.toml (or the stand-in's) changed, or the extras grew, since the last install (stamp:
# their hash), so a plain restart shows no pip output.
stamp=.venv/.run-local-installed
want="$(cat pyproject.toml standin/pyproject.toml | sha256sum | cut -d' ' -f1)"
have="$(cat "$stamp" 2>/dev/null || true)"
if [ ! -x .venv/bin/dsv4-agent ] || [ ! -x .venv/bin/vllm-standin ] || [ "${have%% *}" != "$want" ] \
   || { [ "$extras" = local,proxy ] && [ "${have#* }" = local ]; }; then
  EXTRAS=$extras scripts/install-dev.sh >&2   # writes the stamp
fi
if $container; then
  if ! command -v podman >/dev/null || ! command -v runc >/dev/null; then
    echo "run-local --container: needs podman and runc (apt-get install -y --no-install-recommends podman runc)" >&2
    exit 69
  fi
  home="${DSV4_AGENT_HOME:-$PWD/.dsv4-agent}"
  export DSV4_AGENT_HOME="$home" DSV4_STANDIN_MODEL="${DSV4_STANDIN_MODEL:-$PWD/config/standin-model}"
  image="$(bash scripts/build-test-image.sh)"   # the first time: a Debian rootfs (~1 min), then podman import
  cfg="$(.venv/bin/python scripts/local_container_config.py "$image" "$home/container.yaml" "$home")"
  echo "dsv4-agent: container mode on $cfg (container dsv4-local, image $image; .venv/bin/nodeagentctl --config" \
       "$cfg shell: a shell inside)" >&2
  exec .venv/bin/dsv4-agent --config "$cfg" "$@"
fi
if ! $cluster; then
  echo "dsv4-agent: starting on config/local.yaml (logs: .dsv4-agent/logs/, state: .dsv4-agent/state/)" >&2
  exec .venv/bin/dsv4-agent --config config/local.yaml "$@"
fi

# ---- three agents from one file
[ -f .cache/vllm-ascend/examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py ] \
  || .venv/bin/python scripts/fetch_vllm_ascend_examples.py >/dev/null
home="${DSV4_CLUSTER_HOME:-$PWD/.dsv4-cluster}"
export DSV4_CLUSTER_HOME="$home" DSV4_PYTHON="$PWD/.venv/bin/python"
base="${DSV4_API_PORT_BASE:-18700}"
pids=()
stop_all() {
  trap - INT TERM
  echo "run-local: stopping the agents (each stops its stack in reverse order)…" >&2
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  echo "run-local: all stopped" >&2
  exit 0
}
trap stop_all INT TERM
i=0
for node in n0 n1 n2; do
  mkdir -p "$home/$node"
  DSV4_NODE_NAME=$node DSV4_API_PORT=$((base + i)) \
    .venv/bin/dsv4-agent --config config/local-cluster.yaml "$@" >>"$home/$node/agent.log" 2>&1 &
  pids+=("$!")
  i=$((i + 1))
done
cat >&2 <<INFO
run-local: three agents of cluster local-cluster (one file: config/local-cluster.yaml), state under $home/
  n0 (master: etcd 127.0.0.1:12379, prefill0, the PD proxy)  API http://127.0.0.1:$base        log $home/n0/agent.log
  n1 (decode0 head)                                          API http://127.0.0.1:$((base + 1))    log $home/n1/agent.log
  n2 (decode0, headless)                                     API http://127.0.0.1:$((base + 2))    log $home/n2/agent.log
  .venv/bin/nodeagentctl --node n1 status -c config/local-cluster.yaml   (any member: --node picks the local agent)
  .venv/bin/nodeagentctl --node n0 cluster -c config/local-cluster.yaml  (members, groups, generations)
  (-c names this stack: another stack's n0 on this host is refused, never answers for it)
  curl -s 127.0.0.1:18020/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model":"dsv4","prompt":"hello","max_tokens":8}'        (through the proxy: prefill n0, decode n1+n2)
Ctrl-C stops all three.
INFO
wait
