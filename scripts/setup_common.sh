# Sourced by scripts/setup.sh, scripts/setup_engine.sh, scripts/test.sh and .ci/run: pip's network retries and a
# free-space check, so that a flaky link or a full disk ends a set-up with one line that says so.
#
# A dropped link: the first run downloads multi-GB CUDA builds of torch and its nvidia-* wheels (one CI run lost
# its link at 302 of 366 MB, six times). pip resumes a broken download PIP_RESUME_RETRIES times (pip >= 25.1;
# the older pip a fresh venv starts with ignores the variable) and retries a failed request PIP_RETRIES times.
export PIP_RETRIES=${PIP_RETRIES:-10}
export PIP_RESUME_RETRIES=${PIP_RESUME_RETRIES:-30}

# need_space WHO GB WHAT: exit 1 with one line when the checkout's file system has less than GB GiB free for WHAT.
# A disk that fills during pip's unpacking leaves a half-made venv and "[Errno 28] No space left on device" in
# pip's output (one CI run; the venvs of a fresh checkout take ~14 GB: .venv ~6, .venv-engine ~6.5, .venv-py3.11 ~2).
need_space() {
  local free
  free=$(df -Pk . 2>/dev/null | awk 'NR==2 {print int($4 / 1048576)}')
  [ -n "$free" ] || return 0
  if [ "$free" -lt "$2" ]; then
    echo "$1: needs ~$2 GB free on $(df -P . | awk 'NR==2 {print $6}') for $3; $free GB are free." \
      "Free some space (old clones, caches under /tmp) and rerun"
    exit 1
  fi
}
