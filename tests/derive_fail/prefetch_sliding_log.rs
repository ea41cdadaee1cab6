use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(rule(limit = 1000, period = "1m"), prefetch = 100)]
struct Hot;

fn main() {}
