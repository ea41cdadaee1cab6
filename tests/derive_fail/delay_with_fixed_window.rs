use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(algorithm = "fixed_window", mode = "delay", max_delay = "1s", rule(limit = 5, period = "60s"))]
struct Bad;

fn main() {}
