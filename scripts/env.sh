# Source this file (`. scripts/env.sh`) to put the programs of a build on
# PATH: neuroctl, neurocoord and neuronode from build/ (or $NL_BUILD_DIR),
# as the README's examples call them.
_nl_root=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)
_nl_build=${NL_BUILD_DIR:-$_nl_root/build}
if [ -x "$_nl_build/cli/neuroctl" ]; then
  export PATH="$_nl_build/cli:$_nl_build/coordinator:$_nl_build/node:$PATH"
else
  echo "scripts/env.sh: no build in $_nl_build (run scripts/demo.sh or scripts/test.sh first)" >&2
fi
unset _nl_root _nl_build
