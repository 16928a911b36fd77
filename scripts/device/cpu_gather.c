// CPU gather microbenchmark: random 512-byte rows from a large buffer into a staging buffer.
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static char *pool, *stage; static uint64_t *idx; static int nrows, nthreads;
static atomic_int next_chunk, done_threads, go_epoch; static int CH=64;
static void gather_chunk(int c){int a=c*CH,b=a+CH; if(b>nrows)b=nrows;
  for(int i=a;i<b;i++){ if(i+8<b){const char*q=pool+idx[i+8]*512; for(int o=0;o<512;o+=64) __builtin_prefetch(q+o);} memcpy(stage+(size_t)i*512,pool+idx[i]*512,512);} }
static void* worker(void*arg){ int seen=0; for(;;){ int e; while((e=atomic_load(&go_epoch))==seen); if(e<0) return 0; seen=e;
  int nch=(nrows+CH-1)/CH; for(;;){int c=atomic_fetch_add(&next_chunk,1); if(c>=nch)break; gather_chunk(c);} atomic_fetch_add(&done_threads,1);} }
int cmp(const void*a,const void*b){uint64_t x=*(uint64_t*)a,y=*(uint64_t*)b;return x<y?-1:x>y;}
int dcmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  size_t span=(size_t)atol(argv[1])<<30; int huge=atoi(argv[2]);
  pool=mmap(0,span,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
  if(huge) madvise(pool,span,MADV_HUGEPAGE);
  double t0=now(); memset(pool,1,span); printf("span %zu GiB huge %d: touched in %.1f s\n",span>>30,huge,now()-t0);
  int sizes[]={6617,20000}; int threads[]={1,2,4,8,12,15};
  stage=malloc((size_t)20000*512); memset(stage,0,(size_t)20000*512); idx=malloc(20000*8);
  uint64_t s=12345;
  for(int ti=0;ti<6;ti++){ nthreads=threads[ti]; pthread_t th[16]; atomic_store(&go_epoch,0);
    for(int k=0;k<nthreads-1;k++) pthread_create(&th[k],0,worker,0);
    for(int si=0;si<2;si++) for(int sorted=0;sorted<2;sorted++){ nrows=sizes[si]; double ts[100];
      for(int it=0;it<100;it++){
        for(int i=0;i<nrows;i++){s=s*6364136223846793005ULL+1442695040888963407ULL; idx[i]=(s>>20)%(span/512);} if(sorted) qsort(idx,nrows,8,cmp);
        atomic_store(&next_chunk,0); atomic_store(&done_threads,0);
        double t=now(); atomic_fetch_add(&go_epoch,1);
        int nch=(nrows+CH-1)/CH; for(;;){int c=atomic_fetch_add(&next_chunk,1); if(c>=nch)break; gather_chunk(c);}
        while(atomic_load(&done_threads)<nthreads-1);
        ts[it]=now()-t; }
      qsort(ts,100,sizeof(double),dcmp);
      printf("threads %2d rows %5d %s: median %.1f us p90 %.1f us  %.1f Mrows/s  %.1f GB/s\n",nthreads,nrows,sorted?"sorted":"random",ts[50]*1e6,ts[90]*1e6,nrows/ts[50]/1e6,nrows*512/ts[50]/1e9);}
    atomic_store(&go_epoch,-1); for(int k=0;k<nthreads-1;k++) pthread_join(th[k],0);
  }
}
