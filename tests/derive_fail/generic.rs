use std::marker::PhantomData;

use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(rule(limit = 5, period = "60s"))]
struct Generic<T>(PhantomData<T>);

fn main() {}
