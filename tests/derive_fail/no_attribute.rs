use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
struct NoAttribute;

fn main() {}
