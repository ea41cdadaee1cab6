use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(rule(limit = 34359738369, period = "1d"))]
struct Bad;

fn main() {}
