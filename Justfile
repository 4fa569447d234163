# Recipes a newcomer would guess. `just --list` shows them.

# Run Nightshift on this machine (the embedded default), building it first.
run *ARGS:
    cargo run --release -- serve {{ARGS}}

# The whole test suite: installs the test tools (cached under ~/.cache/nightshift), then runs every test.
test *ARGS:
    tests/run {{ARGS}}

# Formatting, lints and the dependency audit, as strict as review is (.ci/run installs cargo-deny).
lint:
    cargo fmt --all -- --check
    cargo clippy --all-targets -- -D warnings
    cargo deny --locked check licenses bans sources

fmt:
    cargo fmt --all

# Benchmarks against the release binary: upload memory, validation speed, batches on S3, line throughput, the latency x concurrency grid, noisy neighbours, the night shift, and the night shift on a family of servers (llama-server among them once `just test` has installed it).
bench:
    cargo build --release
    python3 bench/run.py
    cargo bench --bench throughput
    cargo bench --bench grid
    cargo bench --bench neighbours
    cargo bench --bench night_shift
    cargo bench --bench family

# The controller at scale on a real kube-apiserver (run `just test` once first: it installs the tools).
# 1,000 Batches in progress by default; BENCH_BATCHES=1000,10000 adds 10,000 (about 3 minutes more).
bench-operator:
    cargo build --release
    . ~/.cache/nightshift/kube/env.sh && cargo bench --bench operator

# Regenerate the committed CRDs (and the chart's copy) from the Rust types.
crds:
    cargo run --quiet -- crd > crds/nightshift.yaml
    cp crds/nightshift.yaml charts/nightshift/crds/nightshift.yaml

# Lint the Helm chart (tests/tools/install-helm.sh installs helm).
chart-lint:
    tests/tools/install-helm.sh >/dev/null
    . ~/.cache/nightshift/helm/env.sh && "$HELM" lint --strict charts/nightshift

build:
    cargo build --release

# The container image from the release binary (Dockerfile's BINARY=prebuilt path); CONTAINER=podman works too.
image TAG="nightshift:0.1.0":
    cargo build --release --locked
    mkdir -p target/image && strip -o target/image/nightshift target/release/nightshift
    ${CONTAINER:-docker} build --build-arg BINARY=prebuilt -f Dockerfile -t {{TAG}} target/image

# The docs book (docs/) into target/book, and its links checked (.ci/run installs mdbook under ~/.cache/nightshift).
book:
    PATH="${NIGHTSHIFT_CACHE:-$HOME/.cache/nightshift}/tools/bin:$PATH" mdbook build docs
    python3 tests/tools/check-links.py

# Regenerate the chart's values.schema.json and README.md from the comments of its values.yaml.
chart-docs:
    NIGHTSHIFT_BLESS=1 cargo test --test cluster -- chart::documented::the_values_schema_and_the_chart_readme_are_generated
