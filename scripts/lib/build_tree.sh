# Sourced by the benchmark scripts: build_tree DIR builds the release binaries of the checkout in
# DIR and installs its wheel into DIR/target/bench-venv (made if missing).
build_tree() {
  (
    cd "$1"
    echo "[$(basename "$0")] building release binaries and the wheel in $1" >&2
    cargo build --release -q --bins
    local venv="$1/target/bench-venv"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "maturin>=1.9,<2" numpy
    rm -rf target/bench-wheels
    "$venv/bin/maturin" build -q --release -m python/Cargo.toml -o target/bench-wheels
    "$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps target/bench-wheels/mooncake_rs-*.whl
  )
}
