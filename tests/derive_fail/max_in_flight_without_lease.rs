use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(max_in_flight = 2)]
struct Bad;

fn main() {}
