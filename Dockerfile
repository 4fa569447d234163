# syntax=docker/dockerfile:1
# The one image of every Nightshift role: `nightshift api`, `controller`, `worker`, `serve`.
#
# From source (the Rust build runs inside the build):
#   docker build -t nightshift:0.1.0 .
#
# From a binary built outside (CI caches, air-gapped machines, or a builder that cannot run
# the Rust stage): put the `nightshift` binary alone in a directory and use that directory as
# the build context. Only the runtime stage (and the stage the TLS roots come from) is built:
#   cargo build --release --locked
#   mkdir -p /tmp/nightshift-image && strip -o /tmp/nightshift-image/nightshift target/release/nightshift
#   docker build --build-arg BINARY=prebuilt -f Dockerfile -t nightshift:0.1.0 /tmp/nightshift-image
# The binary links against glibc: build it on Debian 12 (bookworm) or older.
#
# Base images are build arguments, so that a mirror or a locally made image can stand in
# (the test suite builds this file with podman from bases made with debootstrap):
#   RUST_IMAGE     the Rust toolchain on bookworm (BINARY=source only)
#   CERTS_IMAGE    any image with Debian's ca-certificates: the TLS roots are copied from it
#   RUNTIME_IMAGE  by default distroless "cc" for Debian 12, tag `nonroot`: glibc, libgcc_s,
#                  the TLS roots, tzdata, /etc/passwd with nonroot (65532), and no shell,
#                  package manager or coreutils. Any glibc image of bookworm or newer will do
#                  (e.g. debian:bookworm-slim, with a shell to debug in). The runtime stage
#                  has no RUN: nothing in it needs a shell.

ARG RUST_IMAGE=rust:1.95-bookworm
ARG CERTS_IMAGE=debian:bookworm-slim
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot
# Where the binary comes from: `source` (built below) or `prebuilt` (the build context).
ARG BINARY=source

FROM ${RUST_IMAGE} AS binary-source
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY benches ./benches
COPY crds ./crds
# Cache mounts keep the registry and the target directory between builds.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin nightshift \
    && install -D -m 0755 --strip target/release/nightshift /out/nightshift

FROM scratch AS binary-prebuilt
COPY nightshift /out/nightshift

FROM binary-${BINARY} AS binary

FROM ${CERTS_IMAGE} AS certs

FROM ${RUNTIME_IMAGE}
# TLS roots for S3 and upstreams over https (rustls reads the system store).
COPY --from=certs /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=binary --chmod=0755 /out/nightshift /usr/local/bin/nightshift
# Non-root, as the chart's securityContext requires (runAsNonRoot, runAsUser 65532);
# nothing is written outside /tmp, so the root filesystem can be read-only.
USER 65532:65532
WORKDIR /tmp
ENV RUST_LOG=info
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/nightshift"]
CMD ["--help"]
