use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(name = "empty", key = "ip")]
struct Bad;

fn main() {}
