use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(rule(limit = 40000, period = "1m", metered), meter(unit = "to kens"))]
struct Tokens;

fn main() {}
