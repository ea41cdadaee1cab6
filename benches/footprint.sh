#!/usr/bin/env bash
# What the crate costs an app to build, beside the peers: fresh debug builds of a hello-world axum
# app alone and with each limiter (default features; this crate also memory-only,
# `default-features = false`), the crates compiled and the wall time, two interleaved rounds. Usage: bash benches/footprint.sh [work dir]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d)}
cd "$work"
echo "apps in $work" >&2
mk() { # name, extra dependency line
  rm -rf "$1"; mkdir -p "$1/src"
  cat > "$1/Cargo.toml" <<TOML
[package]
name = "app-$1"
version = "0.1.0"
edition = "2024"
publish = false
[workspace]
[dependencies]
axum = "0.8"
tokio = { version = "1", features = ["rt-multi-thread", "macros", "net"] }
$2
TOML
  echo 'fn main() { let _app: axum::Router = axum::Router::new().route("/", axum::routing::get(|| async { "hi" })); }' > "$1/src/main.rs"
  (cd "$1" && cargo generate-lockfile -q && cargo fetch -q)
}
mk base ""
mk ours "tower-redis-ratelimit = { path = \"$repo\" }"
mk oursmem "tower-redis-ratelimit = { path = \"$repo\", default-features = false }"
mk governor 'tower_governor = "0.8"'
mk trlredis 'tower-rate-limit-redis = "=1.0.2"'
for round in 1 2; do
  for app in base ours oursmem governor trlredis; do
    rm -rf "$app/target"
    start=$(date +%s.%N)
    out=$(cd "$app" && cargo build --offline 2>&1)
    end=$(date +%s.%N)
    crates=$(echo "$out" | grep -c "Compiling ")
    printf "round %s %-9s crates %4d  wall %6.1f s\n" "$round" "$app" "$crates" "$(echo "$end - $start" | bc)"
  done
done
