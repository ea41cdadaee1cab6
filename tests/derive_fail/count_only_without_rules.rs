use tower_redis_ratelimit::LimitPolicy;

#[derive(LimitPolicy)]
#[rate_limit(max_in_flight = 2, lease = "30s", count_only = ["5xx"])]
struct Slots;

fn main() {}
