use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(rule(limit = 60, period = "1m"), rule(limit = 40000, period = "1m", metered))]
struct Tokens;

fn main() {}
