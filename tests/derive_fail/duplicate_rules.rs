use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(rule(limit = 5, period = "60s"), rule(limit = 5, period = "1m"))]
struct Bad;

fn main() {}
