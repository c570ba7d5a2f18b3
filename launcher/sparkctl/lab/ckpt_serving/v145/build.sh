#!/bin/sh
# v145 layer: replace the image's exllamav3 with this one (lab test payload: pure Python, no CUDA).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python3 "$here/patch_aarch64.py" "$here/exllamav3"
version=$(cd "$here" && python3 -c 'import exllamav3; print(exllamav3.__version__)')
rm -rf "$site/exllamav3" "$site"/exllamav3-*.dist-info
cp -r "$here/exllamav3" "$site/exllamav3"
mkdir -p "$site/exllamav3-$version.dist-info"
printf 'Metadata-Version: 2.1\nName: exllamav3\nVersion: %s\n' "$version" > "$site/exllamav3-$version.dist-info/METADATA"
echo "installed exllamav3 $version"
