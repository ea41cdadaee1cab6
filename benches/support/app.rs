//! The app the in-process benches send requests through: one route answering `"hello"`, and the
//! request they send, always from one client, so every request hits the same bucket. Shared by the
//! benches with `#[path]`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::Request;
use axum::routing::get;

/// The one client every request comes from.
pub const CLIENT: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(203, 0, 113, 7)), 40_000);

/// The router: one route, no other middleware.
pub fn router() -> Router {
    Router::new().route("/", get(|| async { "hello" }))
}

/// The request, built the same way every time.
pub fn request() -> Request<Body> {
    let mut request = Request::get("/")
        .body(Body::empty())
        .expect("a valid request");
    request.extensions_mut().insert(ConnectInfo(CLIENT));
    request
}
