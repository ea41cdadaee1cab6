use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(rule(limit = 5, period = "60s", burst = 10))]
struct Bad;

fn main() {}
