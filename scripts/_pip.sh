# Sourced by the scripts here. pip_install ARGS...: pip install -q into the python3 on PATH (a venv, if one is
# active), root-user warnings filtered out; a failed install prints pip's errors and stops the calling script.
pip_install() {
    local log
    log=$(mktemp)
    if ! python3 -m pip install -q "$@" >"$log" 2>&1; then
        grep -v "as the 'root' user" "$log" >&2 || true
        rm -f "$log"
        echo "setup: 'pip install $*' failed (pip's messages above); stopped before running anything" >&2
        exit 1
    fi
    grep -v "as the 'root' user" "$log" || true
    rm -f "$log"
}
