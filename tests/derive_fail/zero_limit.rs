use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(rule(limit = 10, period = "60s"), rule(limit = 0, period = "1h"))]
struct Bad;

fn main() {}
