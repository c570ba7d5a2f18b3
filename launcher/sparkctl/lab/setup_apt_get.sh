#!/bin/sh
# The lab's stand-in for `apt-get` under a host's setup root ($SPARKCTL_SETUP_ROOT/sbin/apt-get: setup_apply.sh
# runs a command there, when it exists, instead of recording it). `apt-get install ... earlyoom` "installs" the
# real earlyoom of this machine into the host's root (a link at ROOT/usr/bin/earlyoom), which is where setup's
# probe looks under a root; any other package is refused. Installed by `sparkctl lab up`.
set -eu
R=${SPARKCTL_SETUP_ROOT:?}
for a in "$@"; do
    case $a in
        earlyoom)
            real=$(command -v earlyoom || true)
            [ -n "$real" ] || { echo "apt-get (lab): earlyoom is not installed on the lab's machine (one-shot.sh's TEST_PACKAGES has it)" >&2; exit 100; }
            mkdir -p "$R/usr/bin"
            ln -sf "$real" "$R/usr/bin/earlyoom"
            echo "apt-get $*" >>"$R/commands.log"
            exit 0 ;;
    esac
done
echo "apt-get (lab): only earlyoom can be installed on a lab host: $*" >&2
exit 100
