use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(rule(limit = 5, period = "60s"), block_for = "0s")]
struct Bad;

fn main() {}
