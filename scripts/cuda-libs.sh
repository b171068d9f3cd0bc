# Sourced by the GPU scripts: put the folders holding the CUDA libraries that pdserve
# loads at run time (cudarc: libcuda from the driver, libcublas(Lt), libnvrtc, libnccl)
# on LD_LIBRARY_PATH, from the CUDA toolkit or the nvidia-* Python wheels.
#
# cudarc opens NCCL as libnccl.so (or .so.<CUDA major>), while the nvidia-nccl wheels ship
# only libnccl.so.2: such a library is linked as libnccl.so from a private folder.

find_lib_dir() {
  local name=$1 d
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    [ -e "$d/$name" ] && { echo "$d"; return; }
  done
  if command -v python3 >/dev/null 2>&1; then
    for d in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
      local hit
      hit=$(find "$d/nvidia" -name "$name" 2>/dev/null | head -n1)
      [ -n "$hit" ] && { dirname "$hit"; return; }
    done
  fi
  return 0  # nothing printed: not found (callers run under set -e)
}

add_lib_dir() {
  case ":${LD_LIBRARY_PATH:-}:" in *":$1:"*) ;; *) export LD_LIBRARY_PATH="$1${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}";; esac
}

# cuda_libs SCRIPT_NAME: find every library, warn (as SCRIPT_NAME) about missing ones.
cuda_libs() {
  local who=$1 lib d
  for lib in libnvrtc.so.13 libcublas.so.13 libcublasLt.so.13; do
    d=$(find_lib_dir "$lib")
    if [ -n "$d" ]; then add_lib_dir "$d"; else echo "$who: warning: $lib not found" >&2; fi
  done
  # NCCL is only needed for GPU-to-GPU transfers: no warning when it is absent.
  d=$(find_lib_dir libnccl.so)
  if [ -n "$d" ]; then add_lib_dir "$d"; return; fi
  d=$(find_lib_dir libnccl.so.2)
  if [ -n "$d" ]; then
    local links
    links=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-nccl.XXXXXX")
    ln -s "$d/libnccl.so.2" "$links/libnccl.so"
    add_lib_dir "$d"
    add_lib_dir "$links"
  fi
}
