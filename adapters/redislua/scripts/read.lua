-- KEYS[1] the hash. Returns {value or false, fence or false}.
return redis.call('HMGET', KEYS[1], 'v', 'f')
