# Shared by the GPU cluster scripts (sourced): start a role and read the address it
# listens on; stop everything started. Needs $work, a scratch folder. Roles start inside
# `$(...)` subshells, so their pids go to files, not to a shell array.

# start NAME CMD...: run CMD with its output in $work/NAME.{out,err}; echo the address it
# listens on (120 s deadline).
start() {
  local name=$1; shift
  "$@" >"$work/$name.out" 2>"$work/$name.err" &
  local pid=$!
  echo "$pid" >"$work/$name.pid"
  for _ in $(seq 1200); do
    local addr
    addr=$(sed -n 's/.*listening on //p' "$work/$name.out" | head -n1)
    if [ -n "$addr" ]; then echo "$addr"; return; fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "$(basename "$0"): $name exited:" >&2; tail -5 "$work/$name.err" >&2; return 1
    fi
    sleep 0.1
  done
  echo "$(basename "$0"): $name did not start in 120 s" >&2; return 1
}

# stop_all: SIGTERM every role started, then wait (10 s) until they are gone.
stop_all() {
  local f pids=()
  for f in "$work"/*.pid; do
    [ -e "$f" ] || continue
    pids+=("$(cat "$f")"); rm -f "$f"
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  kill "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 100); do
    kill -0 "${pids[@]}" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -9 "${pids[@]}" 2>/dev/null || true
}
