use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(rule(limit = 300u8, period = "60s"))]
struct Bad;

fn main() {}
