use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(algorithm = "leaky_bucket", rule(limit = 5, period = "60s"))]
struct Bad;

fn main() {}
