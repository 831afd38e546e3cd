# Sourced by the scripts that run a whole measurement in one device call (issue7.sh, sweep_all.sh).
#   device_outputs NAME DEST   makes DEST, copies everything printed from then on to DEST/NAME.log, sets
#                              $out (a temporary folder for the script's files) and, on exit, packs $out
#                              into DEST/NAME.tar.gz (the device tool returns only a handful of files a call)
#   step TEXT                  a timestamped heading
device_outputs() {
    mkdir -p "$2"
    dest=$(cd "$2" && pwd)
    out=$(mktemp -d)
    exec > >(tee "$dest/$1.log") 2>&1
    trap "tar -czf '$dest/$1.tar.gz' -C '$out' . && rm -rf '$out'" EXIT
}
step() { echo "== $(date -u +%H:%M:%S) $*"; }
