use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(rule(limit = 5, period = "1500us"))]
struct Bad;

fn main() {}
