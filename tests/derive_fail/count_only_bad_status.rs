use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(rule(limit = 5, period = "1m"), count_only = [401, "6xx"])]
struct Failures;

fn main() {}
