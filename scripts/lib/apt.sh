# Sourced by the scripts: `ensure_apt PACKAGE...` installs the Debian packages that are
# missing (as root, non-interactively, without recommends) and leaves the others alone. The
# package lists are fetched once per script (a later call, in the same shell or a subshell,
# reuses them).
ensure_apt() {
  local missing=() p
  for p in "$@"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    [ -n "${APT_LISTS_FETCHED:-}" ] || apt-get update -qq
    APT_LISTS_FETCHED=1
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}
