#!/bin/bash
# Wheels for a GPU host that cannot reach a package index.
#
# Run on a machine that can reach the index, from anywhere inside the project:
#
#   bash tools/offline_wheels.sh [-o DIR] [-p PYTHON_VERSION] [-t PLATFORM]... [-e EXTRAS]
#                                [--with-torch] [PACKAGE...]
#
# It resolves the project's dependencies and extras (default `deepep,hf`), plus any PACKAGE
# (`transformers==5.23.0`), for the GPU host's Python (default 3.12) and platform (default
# manylinux x86_64), downloads those wheels into DIR (default `.whl/` at the project root,
# ignored by git) and writes there:
#   requirements.txt  what was asked for (the host's pip resolves it against what it has)
#   install.sh        `bash .whl/install.sh`: installs the wheels and the project, editable, with
#                     `pip install --no-index --find-links .whl -e ".[EXTRAS]"`
#   prelude.sh        `source .whl/prelude.sh && COMMAND`: for a host whose installed packages
#                     must stay as they are; installs the wheels that the host lacks into
#                     /tmp/site (DBO_SITE; put on PYTHONPATH), the project editable without
#                     dependencies, and prints the torch, deep_ep and greenlet versions
#   versions.py       the versions check both end with
# Copy DIR with the source tree to the GPU host and run one of the two from the project root.
#
# torch and the CUDA libraries it pulls in (nvidia-*, triton) are left out: a GPU host keeps
# the torch built for its CUDA, which the DeepEP wheel must match (CUDA 13). --with-torch
# downloads them too, for a host without torch.
#
# Options, or the environment variables in brackets:
#   -o DIR           [WHEEL_DIR]       where the wheels go (default: <project root>/.whl)
#   -p VERSION       [PYTHON_VERSION]  the GPU host's Python, e.g. 3.12 (default 3.12)
#   -t TAG           [PLATFORMS]       a platform tag the host accepts; repeatable (default:
#                                      manylinux_2_28 down to manylinux2014, x86_64)
#   -e EXTRAS        [EXTRAS]          the project's extras, comma-separated (default deepep,hf)
#   --with-torch     [WITH_TORCH=1]    also torch and its CUDA libraries
#   PACKAGE...       [EXTRA_WHEELS]    more requirements, e.g. transformers==5.23.0
# PIP (default `python3 -m pip`) is the pip that downloads.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${WHEEL_DIR:-$root/.whl}
pyver=${PYTHON_VERSION:-3.12}
read -r -a platforms <<< "${PLATFORMS:-manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64}"
extras=${EXTRAS:-deepep,hf}
with_torch=${WITH_TORCH:-0}
read -r -a packages <<< "${EXTRA_WHEELS:-}"
read -r -a pip <<< "${PIP:-python3 -m pip}"
user_platforms=()
while (($#)); do
  if [[ $1 =~ ^-[opte]$ ]] && (($# < 2)); then
    echo "offline_wheels.sh: $1 needs a value (-h lists the options)" >&2; exit 2
  fi
  case $1 in
    -o) out=$2; shift 2 ;;
    -p) pyver=$2; shift 2 ;;
    -t) user_platforms+=("$2"); shift 2 ;;
    -e) extras=$2; shift 2 ;;
    --with-torch) with_torch=1; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "offline_wheels.sh: unknown option $1 (allowed: -o DIR, -p VERSION, -t TAG, -e EXTRAS, --with-torch, -h)" >&2
        exit 2 ;;
    *) packages+=("$1"); shift ;;
  esac
done
((${#user_platforms[@]})) && platforms=("${user_platforms[@]}")
if ! [[ $pyver =~ ^3\.[0-9]+$ ]]; then
  echo "offline_wheels.sh: Python version '$pyver' is not of the form 3.N (e.g. 3.12)" >&2; exit 2
fi
if [[ ! $extras =~ ^[A-Za-z0-9_,-]*$ ]]; then
  echo "offline_wheels.sh: extras '$extras' must be names separated by commas (e.g. deepep,hf)" >&2; exit 2
fi

mkdir -p "$out"
out=$(cd "$out" && pwd)
target_opts=(--only-binary=:all: --python-version "$pyver" --implementation cp)
for p in "${platforms[@]}"; do target_opts+=(--platform "$p"); done

# The requirements: the project's own and its extras' (read from pyproject.toml), then PACKAGEs.
python3 - "$root/pyproject.toml" "$extras" "$with_torch" "${packages[@]}" > "$out/requirements.txt" <<'EOF'
import re
import sys

try:
    import tomllib
except ImportError:  # Python < 3.11: the copy pip carries
    from pip._vendor import tomli as tomllib

path, extras, with_torch, *packages = sys.argv[1:]
with open(path, "rb") as f:
    project = tomllib.load(f)["project"]
optional = project.get("optional-dependencies", {})
reqs = list(project.get("dependencies", []))
for extra in filter(None, extras.split(",")):
    if extra not in optional:
        print(f"offline_wheels.sh: no extra {extra!r} in pyproject.toml (allowed: {', '.join(optional)})",
              file=sys.stderr)
        sys.exit(2)
    reqs += optional[extra]
reqs += packages
for req in dict.fromkeys(reqs):
    if with_torch != "1" and re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower() == "torch":
        continue  # the host's own torch satisfies it
    print(req)
EOF

# Resolve for the host (nothing installed), then download all but torch's CUDA stack, one pip
# call, wheels only. The build requirement (setuptools) lets `pip install -e .` run offline.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
build_reqs=$(python3 - "$root/pyproject.toml" <<'EOF'
import sys

try:
    import tomllib
except ImportError:
    from pip._vendor import tomli as tomllib

with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f).get("build-system", {}).get("requires", [])))
EOF
)
printf '%s\n' "$build_reqs" > "$tmp/build.txt"
echo "resolving for CPython $pyver on ${platforms[*]} ..." >&2
"${pip[@]}" install -q --dry-run --ignore-installed --report "$tmp/report.json" --target "$tmp/t" \
  "${target_opts[@]}" -r "$out/requirements.txt" -r "$tmp/build.txt"
mapfile -t pins < <(python3 - "$tmp/report.json" "$with_torch" <<'EOF'
import json
import re
import sys

report, with_torch = sys.argv[1:]
cuda_stack = re.compile(r"^(torch|triton|pytorch-triton.*|nvidia-.*|cuda-.*)$")
for item in json.load(open(report))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if with_torch == "1" or not cuda_stack.match(re.sub(r"[-_.]+", "-", name).lower()):
        print(f"{name}=={version}")
EOF
)
echo "downloading ${#pins[@]} wheels into $out ..." >&2
"${pip[@]}" download -q --no-deps "${target_opts[@]}" -d "$out" "${pins[@]}"

# The two ways to install on the host, written beside the wheels.
needs_deep_ep=0
grep -qi '^tokenspeed-deepep\|^deep-ep\|^deep_ep' "$out/requirements.txt" && needs_deep_ep=1
cat > "$out/install.sh" <<EOF
#!/bin/bash
# Written by tools/offline_wheels.sh for CPython $pyver. Run from the project root on the GPU
# host: installs the wheels of this folder (only those pip finds missing) and the project,
# editable, with no package index. Extra arguments go to pip (e.g. --user).
set -euo pipefail
here=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)
\${PYTHON:-python3} -m pip install --no-index --find-links "\$here" -r "\$here/requirements.txt" "\$@" -e ".[$extras]"
\${PYTHON:-python3} "\$here/versions.py" $needs_deep_ep
EOF
cat > "$out/prelude.sh" <<EOF
# Written by tools/offline_wheels.sh for CPython $pyver. Sourced from the project root on the GPU
# host, before a command:   source .whl/prelude.sh && bash tests/gpu/run.sh core
# The host's installed packages stay as they are: the wheels of this folder that the host lacks
# (as its pip resolves requirements.txt) go into \${DBO_SITE:-/tmp/site}, put first on
# PYTHONPATH; the project is installed editable without its dependencies.
_dbo_whl=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)
_dbo_site=\${DBO_SITE:-/tmp/site}
case ":\${PYTHONPATH:-}:" in *":\$_dbo_site:"*) ;; *) export PYTHONPATH=\$_dbo_site\${PYTHONPATH:+:\$PYTHONPATH} ;; esac
export PYTHONUNBUFFERED=1
_dbo_report=\$(mktemp)
if python3 -m pip install -q --dry-run --no-index --find-links "\$_dbo_whl" --report "\$_dbo_report" \\
     -r "\$_dbo_whl/requirements.txt"; then
  _dbo_wheels=\$(python3 -c 'import json, sys, urllib.parse, urllib.request
for item in json.load(open(sys.argv[1]))["install"]:
    print(urllib.request.url2pathname(urllib.parse.urlparse(item["download_info"]["url"]).path))' "\$_dbo_report")
else
  echo "prelude.sh: pip could not resolve \$_dbo_whl/requirements.txt here; installing every wheel of \$_dbo_whl" >&2
  _dbo_wheels=\$(ls "\$_dbo_whl"/*.whl)
fi
rm -f "\$_dbo_report"
if [ -n "\$_dbo_wheels" ]; then
  # shellcheck disable=SC2086  # one wheel path a line, none with spaces
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
    --target "\$_dbo_site" \$_dbo_wheels || return 1
fi
if [ -f pyproject.toml ]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
fi
python3 "\$_dbo_whl/versions.py" $needs_deep_ep || return 1
EOF
cat > "$out/versions.py" <<'EOF'
"""Prints the versions of torch, greenlet and deep_ep and the GPUs; exits 1 if one is missing
(deep_ep only when the first argument is 1). Written by tools/offline_wheels.sh."""
import importlib
import importlib.metadata
import sys

need_deep_ep = sys.argv[1:] == ["1"]
missing = []
for module in ("torch", "greenlet", "deep_ep"):
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        print(f"{module}: not importable ({exc})")
        if module != "deep_ep" or need_deep_ep:
            missing.append(module)
        continue
    dists = importlib.metadata.packages_distributions().get(module, [module])
    version = getattr(mod, "__version__", None) or importlib.metadata.version(dists[0])
    print(f"{module} {version} ({dists[0]})", end="")
    print(f", {mod.cuda.device_count()} GPUs, CUDA {mod.version.cuda}" if module == "torch" else "")
sys.exit(1 if missing else 0)
EOF
chmod +x "$out/install.sh"
ls -la "$out" >&2
echo "on the GPU host, from the project root:  bash ${out/#$root\//}/install.sh   or   source ${out/#$root\//}/prelude.sh && COMMAND" >&2
