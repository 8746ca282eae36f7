#!/bin/bash
# Experiment: CRIU's restore with its pages served lazily by `criu lazy-pages`.
real="${LAZY_REAL_CRIU:?}"
if [ "$1" = restore ]; then
  images="" work=""
  args=("$@")
  for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[$i]}" in
      --images-dir) images="${args[$((i + 1))]}" ;;
      --work-dir) work="${args[$((i + 1))]}" ;;
    esac
  done
  "$real" lazy-pages --images-dir "$images" --work-dir "$work" --log-file "$work/lazy.log" -v4 &
  for _ in $(seq 200); do [ -S "$work/lazy-pages.socket" ] && break; sleep 0.002; done
  "$real" "$@" --lazy-pages
  rc=$?
  echo "lazy-wrapper: restore rc=$rc" >> "$work/lazy-wrapper.txt"
  exit $rc
fi
exec "$real" "$@"
