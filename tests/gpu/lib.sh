# What the GPU scripts share; sourced after they set $log, $steps and, optionally, $deadline
# (a value of $SECONDS after which no step starts; each step's cap is cut to what is left).
# shellcheck shell=bash
status=0
run() {  # run NAME CAP_S CMD...: log the command, its output and its exit code
  local name=$1 cap=$2; shift 2
  if [ -n "${deadline:-}" ]; then
    local left=$((deadline - SECONDS))
    if [ "$left" -lt 20 ]; then
      echo "=== [$name] SKIPPED: ${left}s left of the deadline" | tee -a "$log"
      status=1
      return
    fi
    [ "$cap" -gt "$left" ] && cap=$left
  fi
  echo "=== [$name] (cap ${cap}s) \$ $*" | tee -a "$log"
  local t0=$SECONDS
  timeout -k 10 "$cap" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== [$name] rc=$rc (took $((SECONDS - t0)) s)" | tee -a "$log"
  [ "$rc" -eq 0 ] || status=1
}
has() { [[ " ${steps:-} " == *" $1 "* ]]; }
