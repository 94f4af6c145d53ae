#!/usr/bin/env bash
# Install bubblewrap (Debian/Ubuntu package) so the sandbox service can use namespaces, and libseccomp2,
# which builds the seccomp filter its commands run under (through the pyseccomp package).
# Never fails the build: without bwrap the service falls back to subprocess + rlimits and says so
# on /v1/health; as root it then refuses to start if commands could only run as root (pass
# --allow-root-commands to accept that).
set -u

if command -v bwrap >/dev/null 2>&1 && ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2'; then
  echo "bubblewrap and libseccomp already installed: $(command -v bwrap)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "apt-get not found: skipping bubblewrap (the sandbox service will use its fallback)"
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "not root and no passwordless sudo: skipping bubblewrap (the sandbox service will use its process fallback)"
    exit 0
  fi
fi
if $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq bubblewrap libseccomp2; then
  echo "installed bubblewrap and libseccomp2: $(command -v bwrap)"
else
  echo "could not install bubblewrap: the sandbox service will use its fallback"
fi
exit 0
