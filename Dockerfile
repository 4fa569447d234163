# syntax=docker/dockerfile:1
# The one image of every Nightshift role: `nightshift api`, `controller`, `worker`, `serve`.
#
#   docker build -t nightshift:0.1.0 .
#
# The builder and the runtime use the same Debian release (bookworm), so the binary finds
# the glibc it was linked against. Any minimal glibc image of that release works as the
# runtime (e.g. a distroless "cc" image for Debian 12, tag `nonroot`):
#   docker build --build-arg RUNTIME_IMAGE=<image> -t nightshift .

ARG RUST_IMAGE=rust:1.95-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY benches ./benches
COPY crds ./crds
# Cache mounts keep the registry and the target directory between builds.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin nightshift \
    && install -D -m 0755 target/release/nightshift /out/nightshift

FROM ${RUNTIME_IMAGE}
# TLS roots for S3 and upstreams over https (rustls reads the system store).
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /out/nightshift /usr/local/bin/nightshift
# Non-root, as the chart's securityContext requires (runAsNonRoot, runAsUser 65532);
# nothing is written outside /tmp, so the root filesystem can be read-only.
USER 65532:65532
WORKDIR /tmp
ENV RUST_LOG=info
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/nightshift"]
CMD ["--help"]
